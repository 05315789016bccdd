"""TP=2/3 logits equal TP=1 (gloo process groups on CPU), including uneven KV-head splits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from mtpserve.modeling.attention import AttentionMetadata
from mtpserve.modeling.families import model_class
from mtpserve.modeling.model import LlamaArgs
from mtpserve.modeling.parallel import TPContext, split_evenly
from mtpserve.workers.distributed import free_port, init_tp_group
from tests.helpers.deepseek_tiny import tiny_deepseek_args, tiny_deepseek_weights
from tests.helpers.tiny import random_prompts, tiny_args, tiny_weights

BS = 8


def _forward(args: LlamaArgs, weights: dict, tp: TPContext, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill two chunks per prompt through the paged model; returns logits of every row."""
    model = model_class(args)(args, tp)
    model.load_hf_state_dict(weights)
    model.eval()
    cache = model.allocate_cache(64, BS, "cpu")
    tables = [[2 * i, 2 * i + 1, 40 + i] for i in range(len(prompts))]
    out = []
    with torch.no_grad():
        for lo, hi in ((0, 5), (5, None)):
            chunks = [p[lo:hi] for p in prompts]
            starts = [lo] * len(prompts)
            ids = torch.tensor([t for c in chunks for t in c])
            pos = torch.cat([torch.arange(s, s + len(c)) for s, c in zip(starts, chunks, strict=True)])
            meta = AttentionMetadata.build(starts, [len(c) for c in chunks], tables, BS)
            out.append(model.logits(model(ids, pos, cache, meta)))
    return torch.cat(out)


def _rank_main(rank: int, world: int, master: str, args: LlamaArgs, weights: dict, prompts: list, q: mp.Queue):
    torch.set_num_threads(1)
    tp = init_tp_group(rank, world, master, "cpu")
    logits = _forward(args, weights, tp, prompts)
    if rank == 0:
        q.put(logits)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_tp(world: int, args: LlamaArgs, weights: dict, prompts: list[list[int]]) -> torch.Tensor:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    master = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, master, args, weights, prompts, q)) for r in range(world)]
    for p in procs:
        p.start()
    logits = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return logits


def test_split_evenly_and_kv_groups() -> None:
    assert split_evenly(3, 2) == [(0, 2), (2, 3)]
    assert split_evenly(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert [TPContext(r, 2).kv_head_range(3) for r in range(2)] == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="tp_size"):
        TPContext(0, 4).kv_head_range(3)


@pytest.mark.parametrize(
    ("world", "heads", "kv", "tol"),
    [(2, 4, 2, 1e-5), (3, 6, 3, 1e-5), (2, 6, 3, 1e-5)],
    ids=["tp2-even", "tp3", "tp2-uneven"],
)
def test_tp_logits_match_single_rank(world: int, heads: int, kv: int, tol: float) -> None:
    args = tiny_args(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=96, vocab_size=97)
    weights = tiny_weights(args)
    prompts = random_prompts(3, args.vocab_size, [11, 7, 15], seed=3)
    ref = _forward(args, weights, TPContext(), prompts)
    got = run_tp(world, args, weights, prompts)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= tol


@pytest.mark.parametrize("world", [2, 3])
def test_deepseek_tp_logits_match_single_rank(world: int) -> None:
    """MLA heads and every expert's intermediate width split over ranks (3 ranks: uneven splits)."""
    args = tiny_deepseek_args(num_attention_heads=6, num_key_value_heads=6)
    weights = tiny_deepseek_weights(args)
    prompts = random_prompts(3, args.vocab_size, [11, 7, 15], seed=3)
    ref = _forward(args, weights, TPContext(), prompts)
    got = run_tp(world, args, weights, prompts)
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_smollm2_tp2_uneven_split() -> None:
    from tests.helpers.smol import smollm2

    _, args, weights, tok = smollm2()
    args = replace(args, max_position_embeddings=1024)
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog and keeps running.")]
    ref = _forward(args, weights, TPContext(), prompts)
    got = run_tp(2, args, weights, prompts)
    assert (got - ref).abs().max().item() <= 1e-4
