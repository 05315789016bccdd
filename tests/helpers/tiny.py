"""Tiny random Llama targets, draft heads and engines for fast CPU tests."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.model import LlamaArgs, random_llama_weights
from mtpserve.speculative.draft_head import DraftHead
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.workers.config import MTPServeConfig
from mtpserve.workers.runner import TargetRunner
from mtpserve.workers.uniform_step import UniformTargetStep


def tiny_args(**overrides: Any) -> LlamaArgs:
    """A 2-layer GQA Llama with a small vocabulary."""
    base: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        eos_token_id=None,
    )
    base.update(overrides)
    return LlamaArgs(**base)


def tiny_weights(args: LlamaArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights peaky enough that greedy choices are not near-ties."""
    return random_llama_weights(args, seed=seed, std=0.15)


def tiny_head(args: LlamaArgs, weights: dict[str, torch.Tensor] | None = None, seed: int = 1) -> MTPEagleHead:
    """A draft head: copied from the target's last layer when weights are given (some acceptance), else random."""
    head = MTPEagleHead(args)
    if weights is None:
        head.init_random(seed=seed, std=0.15)
    else:
        head.init_from_target(weights)
    return head


def engine_config(**sections: dict[str, Any]) -> MTPServeConfig:
    """A CPU fp32 config with small caches; keyword arguments are config sections."""
    data: dict[str, Any] = {
        "model": {"device": "cpu", "dtype": "float32"},
        "scheduler": {"num_kv_blocks": 256, "block_size": 8, "max_num_requests": 8},
        "speculative": {"draft": None, "num_draft_tokens": 3, "adaptive": False},  # a fixed K unless a test asks
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return MTPServeConfig.model_validate(data)


def tiny_engine(
    args: LlamaArgs,
    weights: dict[str, torch.Tensor],
    head: DraftHead | None = None,
    **sections: dict[str, Any],
) -> LLMEngine:
    """An in-process engine over the given weights; speculation is on iff a head is given."""
    cfg = engine_config(**sections)
    if head is None:
        cfg = cfg.model_copy(update={"speculative": cfg.speculative.model_copy(update={"enabled": False})})
    else:
        head = _clone(head, args)
    return LLMEngine.from_weights(cfg, args, weights, head=head)


def _clone(head: DraftHead, args: LlamaArgs) -> DraftHead:
    if not isinstance(head, MTPEagleHead):
        return copy.deepcopy(head)
    clone = MTPEagleHead(args, **head.layout())
    clone.load_state_dict(head.state_dict())
    return clone


def slots_of(block_ids: list[int], block_size: int, n: int) -> torch.Tensor:
    """Cache slots of positions [0, n) for a block table."""
    pos = torch.arange(n)
    return torch.tensor(block_ids)[pos // block_size] * block_size + pos % block_size


def draft_kv(engine: LLMEngine, request_id: str, n: int, layer: int = 0) -> torch.Tensor:
    """The draft head's K and V (of decoder `layer`) for positions [0, n) of a running request, [2, n, H, D]."""
    req = engine.scheduler.requests[request_id]
    draft = engine.draft
    cache = getattr(draft, "chain", draft).cache  # a tree drafter's KV is its chain's
    k, v = cache.gather(layer, slots_of(req.block_ids, cache.block_size, n))
    return torch.stack([k, v]).clone()


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Reproducible random token prompts."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def mimic_head(args: LlamaArgs, weights: dict[str, torch.Tensor]) -> MTPEagleHead:
    """For a 1-layer target with unit-RMS embeddings: a head that re-runs the target layer on the next token.

    eh_proj passes only the (normalised) token embedding, so draft row i computes nearly the target's
    hidden state at i+1 (it misses only token 0): high but imperfect acceptance, exercising both the
    accept and the reject paths of verification.
    """
    assert args.num_hidden_layers == 1
    head = MTPEagleHead(args)
    head.init_from_target(weights, layer=0)
    d = args.hidden_size
    with torch.no_grad():
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, :d] = torch.eye(d)
    return head


def mimic_target(seed: int = 0, **overrides: Any) -> tuple[LlamaArgs, dict[str, torch.Tensor]]:
    """A 1-layer tiny target whose embeddings have unit RMS (pairs with `mimic_head`)."""
    args = tiny_args(**{"num_hidden_layers": 1, **overrides})
    w = tiny_weights(args, seed)
    g = torch.Generator().manual_seed(seed + 7)
    w["model.embed_tokens.weight"] = torch.randn(args.vocab_size, args.hidden_size, generator=g)
    w["lm_head.weight"] = torch.randn(args.vocab_size, args.hidden_size, generator=g) * 0.3
    return args, w


def save_model_dir(
    path: Any,
    args: LlamaArgs,
    weights: dict[str, torch.Tensor],
    arch: str = "LlamaForCausalLM",
    model_type: str = "llama",
) -> str:
    """Write an HF-style directory (config.json + model.safetensors) that workers can load."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in asdict(args).items() if v is not None}
    cfg.update(architectures=[arch], model_type=model_type)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return str(out)


def rebuilt(runner: Any, **steps: Any) -> TargetRunner:
    """The same target runner built again with these captured steps (`CapturedSteps` fields; off CUDA they run
    eagerly over the fixed buffers CUDA replays); its model, cache and settings carry over."""
    assert isinstance(runner, TargetRunner)
    again = TargetRunner(
        runner.model,
        runner.cache,
        runner.device,
        steps=replace(runner.steps, **steps),
        drafting=runner.drafting,
        lookahead_source=runner.lookahead_source,
        replay=runner.replay,
    )
    again.steps_ahead = runner.steps_ahead
    return again


def with_steps(eng: LLMEngine, **steps: Any) -> TargetRunner:
    """Give an in-process engine's target runner these captured steps (`rebuilt`); returns the new runner."""
    runner = rebuilt(eng.target, **steps)
    eng.use_target(runner)
    return runner


def with_uniform(eng: LLMEngine, k: int, max_blocks: int = 8) -> UniformTargetStep:
    """Give an in-process engine the fixed-buffer generation step (Q = k + 1 rows, buckets up to 8) that
    CUDA builds, run eagerly on CPU over the same buffers."""
    runner = eng.target
    assert isinstance(runner, TargetRunner)
    uniform = UniformTargetStep(
        runner.model, runner.cache, k + 1, max_batch=8, max_blocks=max_blocks, device="cpu", use_graphs=False
    )
    with_steps(eng, target=uniform)
    return uniform


def second_token_counts(eng: LLMEngine, prompt: list[int], n: int, vocab: int) -> torch.Tensor:
    """How often each token comes second (the first token a verification decides) over `n` requests
    sampled at temperature 1 with seeds 0..n-1."""
    ids = [eng.add_request(prompt, {"max_tokens": 2, "temperature": 1.0, "seed": s}) for s in range(n)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id].extend(o.new_token_ids)
    return torch.bincount(torch.tensor([t[1] for t in tokens.values()]), minlength=vocab)


def same_distribution_pvalue(counts: list[torch.Tensor]) -> float:
    """Chi-square contingency p-value that the count vectors come from one distribution (tokens seen fewer
    than 10 times in all are left out)."""
    from scipy.stats import chi2_contingency

    table = torch.stack(counts)
    table = table[:, table.sum(0) >= 10]
    return float(chi2_contingency(table.numpy())[1])


def save_mimic(d: Any) -> tuple[str, str]:
    """The mimic target as an HF directory under folder d, and its MTP head as a file there: (model dir,
    head file), as worker actors load them."""
    from pathlib import Path

    args, w = mimic_target()
    path = save_model_dir(Path(d) / "model", args, w)
    head = str(Path(d) / "head.safetensors")
    mimic_head(args, w).save(head)
    return path, head
