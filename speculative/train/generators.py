"""Text generators used only while building the draft dataset: the `Generator` protocol and HF `generate`.

The project's engine is the other backend (cluster/cli/train_generator.py, passed in by the caller). Both
take token-id prompts and return each continuation's ids (including the stop token when one was
produced) and why it ended. The `hf` backend exists for the GPU data build: our engine is not
CUDA-graphed and its per-step Python cost makes thousands of long responses too slow there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm import tqdm

from mtpserve.modeling.model import LlamaArgs


@dataclass
class GenResult:
    """One continuation: new token ids and 'stop' (hit a stop id) or 'length'."""

    token_ids: list[int]
    finish_reason: str


@dataclass
class GenSettings:
    """Decoding settings of one generate call (temperature 0 = greedy)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()


class Generator(Protocol):
    """Anything that continues a batch of token-id prompts."""

    name: str
    tokens_generated: int  # new tokens so far, stop tokens included
    busy_s: float  # seconds spent generating so far

    def generate(self, prompts: list[list[int]], settings: GenSettings, desc: str = "") -> list[GenResult]:
        """Continue every prompt; results in input order."""
        ...


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> GenResult:
    """Truncate after the first stop id (kept, as the engine does); 'length' when none occurs."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return GenResult(tokens[: i + 1], "stop")
    return GenResult(tokens, "length")


class HFGenerator:
    """HF transformers `LlamaForCausalLM.generate` (left padding, length-sorted batches)."""

    name = "hf"

    def __init__(
        self,
        args: LlamaArgs,
        weights: dict[str, torch.Tensor],
        device: str,
        dtype: torch.dtype,
        batch_size: int,
    ) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(  # built from our LlamaArgs so both implementations share every hyper-parameter
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_hidden_layers,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            head_dim=args.dim_per_head,
            rms_norm_eps=args.rms_norm_eps,
            rope_parameters={**(args.rope_scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta},
            max_position_embeddings=args.max_position_embeddings,
            tie_word_embeddings=args.tie_word_embeddings,
            attention_bias=False,
            mlp_bias=False,
        )
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"HF generator: weights missing {missing[:3]}, unexpected {unexpected[:3]}")
        if config.tie_word_embeddings:
            model.tie_weights()
        model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
        self.model = model.eval()
        self.device = device
        self.batch_size = batch_size
        self.pad_id = 0
        self.tokens_generated = 0
        self.busy_s = 0.0

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], settings: GenSettings, desc: str = "") -> list[GenResult]:
        """Generate in batches; sampling uses a torch seed per batch (seed + batch index)."""
        from transformers import GenerationConfig

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        stop = set(settings.stop_ids)
        sample = settings.temperature > 0
        gen_cfg = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=sample,
            temperature=settings.temperature if sample else None,
            top_p=settings.top_p if sample else None,
            top_k=0 if sample else None,
            eos_token_id=sorted(stop) or None,
            pad_token_id=self.pad_id,
        )
        results: list[GenResult | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        with tqdm(total=len(prompts), desc=desc or "generate (hf)", unit="seq") as bar:
            for b, lo in enumerate(range(0, len(order), self.batch_size)):
                idx = order[lo : lo + self.batch_size]
                width = max(len(prompts[i]) for i in idx)
                ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for r, i in enumerate(idx):
                    ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                    mask[r, width - len(prompts[i]) :] = 1
                torch.manual_seed(settings.seed + b)
                out = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    generation_config=gen_cfg,
                )
                new = out[:, width:].cpu().tolist()
                for r, i in enumerate(idx):
                    results[i] = cut_at_stop(new[r], stop) if stop else GenResult(new[r], "length")
                bar.update(len(idx))
        self.busy_s += time.perf_counter() - t0
        self.tokens_generated += sum(len(r.token_ids) for r in results if r is not None)
        return [r if r is not None else GenResult([], "length") for r in results]
