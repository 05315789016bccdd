"""The ModelInfo message of a served engine: the target, its draft and their limits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mtpserve.modeling.dtype_names import dtype_name
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from mtpserve.cluster.engine.llm_engine import LLMEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_dtype(dtype: str, device: str) -> str:
    """The dtype the weights are in: `auto` resolved for the device ("bfloat16" on CUDA, "float32" on CPU)."""
    return dtype_name(dtype, device) if device in ("cpu", "cuda") else dtype


def model_info(engine: LLMEngine) -> pb.ModelInfo:
    """ModelInfo for an engine, from its config and architecture."""
    cfg, args = engine.cfg, engine.args
    arch, name = "LlamaForCausalLM", DEFAULT_MODEL_NAME
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        name = path.stem if path.is_file() else path.resolve().name
        conf = path / "config.json"
        if conf.is_file():
            arch = (json.loads(conf.read_text()).get("architectures") or [arch])[0]
    spec = cfg.speculative
    device = getattr(engine.target, "device", None) or cfg.model.device  # a remote target has none
    kind = str(getattr(device, "type", device))  # a torch.device or a name
    return pb.ModelInfo(
        model_name=name,
        architecture=arch,
        vocab_size=args.vocab_size,
        max_model_len=engine.max_model_len,
        hidden_size=args.hidden_size,
        num_layers=args.num_hidden_layers,
        tp_size=cfg.parallel.tp_size,
        device=kind,
        dtype=served_dtype(cfg.model.dtype, kind),
        has_tokenizer=engine.tokenizer is not None,
        block_size=cfg.scheduler.block_size,
        draft=pb.DraftInfo(
            enabled=engine.draft is not None,
            method=spec.method if engine.draft is not None else "",
            source=spec.draft or "",
            num_draft_tokens=engine.scheduler.k,
            lookahead_source=spec.lookahead_source,
            placement=cfg.parallel.draft_placement,
        ),
    )
