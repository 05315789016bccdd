"""Target-only greedy output of SmolLM2 equals HF transformers generate() on the same GGUF."""

from __future__ import annotations

import pytest
import torch

from mtpserve.modeling.loader import default_gguf_path
from tests.helpers.smol import CHAT_PROMPTS, smollm2_engine


@pytest.mark.slow
def test_greedy_matches_hf_generate() -> None:
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # both sides generate exactly 32 tokens, EOS included
    eng = smollm2_engine(scheduler={"chunk_size": 16, "max_num_batched_tokens": 256})
    prompts = [eng.encode_prompt(p) for p in CHAT_PROMPTS[:3]]
    ours = eng.generate(prompts, {"max_tokens": 32, "ignore_eos": True})
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=32,
                pad_token_id=2,
            )
        want = ref[0, len(prompt) :].tolist()
        assert len(want) == 32
        assert got.token_ids == want
