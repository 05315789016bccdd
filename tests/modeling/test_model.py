"""Target model: chunked prefill equals whole-prompt prefill; mixed batches equal solo runs."""

from __future__ import annotations

import pytest
import torch

from mtpserve.modeling.attention import AttentionMetadata
from mtpserve.modeling.model import LlamaModel
from tests.helpers.tiny import random_prompts, slots_of, tiny_args, tiny_engine, tiny_weights

BS = 8


def _model() -> tuple[LlamaModel, object]:
    args = tiny_args()
    m = LlamaModel(args)
    m.load_hf_state_dict(tiny_weights(args))
    return m.eval(), args


def _prefill_logits(model: LlamaModel, prompt: list[int], chunk: int) -> torch.Tensor:
    cache = model.allocate_cache(64, BS, "cpu")
    table = list(range(10, 10 + 64 // 2))  # non-trivial block ids
    rows = []
    with torch.no_grad():
        for s in range(0, len(prompt), chunk):
            ids = torch.tensor(prompt[s : s + chunk])
            meta = AttentionMetadata.build([s], [len(ids)], [table], BS)
            h = model(ids, torch.arange(s, s + len(ids)), cache, meta)
            rows.append(model.logits(h))
    return torch.cat(rows)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunked_prefill_matches_whole_prompt(chunk: int) -> None:
    model, _ = _model()
    prompt = random_prompts(1, 96, [70])[0]
    whole = _prefill_logits(model, prompt, len(prompt))
    chunked = _prefill_logits(model, prompt, chunk)
    assert chunked.shape == whole.shape == (70, 96)
    assert (chunked - whole).abs().max().item() <= 1e-4


def test_mixed_batch_equals_each_request_alone() -> None:
    """One forward mixing two context chunks and two decode rows gives each row its solo logits."""
    model, _ = _model()
    p = random_prompts(4, 96, [12, 9, 5, 7], seed=3)
    solo = [_prefill_logits(model, q, len(q)) for q in p]
    cache = model.allocate_cache(64, BS, "cpu")
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    with torch.no_grad():
        # requests 2 and 3 are already prefilled up to their last token, which decodes in the mixed step
        for i in (2, 3):
            ids = torch.tensor(p[i][:-1])
            meta = AttentionMetadata.build([0], [len(ids)], [tables[i]], BS)
            model(ids, torch.arange(len(ids)), cache, meta)
        # request 1 had its first 4 tokens computed earlier (chunked)
        meta = AttentionMetadata.build([0], [4], [tables[1]], BS)
        model(torch.tensor(p[1][:4]), torch.arange(4), cache, meta)
        starts = [0, 4, len(p[2]) - 1, len(p[3]) - 1]
        toks = [p[0], p[1][4:], p[2][-1:], p[3][-1:]]
        ids = torch.tensor([t for seq in toks for t in seq])
        pos = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, toks, strict=True)])
        meta = AttentionMetadata.build(starts, [len(t) for t in toks], tables, BS)
        logits = model.logits(model(ids, pos, cache, meta))
    got = torch.split(logits, [len(t) for t in toks])
    want = [solo[0], solo[1][4:], solo[2][-1:], solo[3][-1:]]
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-4


def test_kv_written_to_the_scheduled_slots() -> None:
    model, _ = _model()
    cache = model.allocate_cache(16, BS, "cpu")
    table = [5, 2, 9]
    with torch.no_grad():
        meta = AttentionMetadata.build([0], [20], [table], BS)
        model(torch.arange(20), torch.arange(20), cache, meta)
    slots = slots_of(table, BS, 20)
    k, _ = cache.gather(0, slots)
    assert k.abs().sum(dim=(1, 2)).gt(0).all()
    total = cache.keys[0].shape[0] * BS  # usable blocks plus the scratch block
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[slots] = False
    assert cache.keys[0].view(total, -1)[untouched].abs().sum().item() == 0.0


def test_engine_chunked_and_batched_greedy_match_solo() -> None:
    args = tiny_args()
    w = tiny_weights(args)
    prompts = random_prompts(5, args.vocab_size, [23, 1, 40, 8, 16], seed=5)
    solo = [tiny_engine(args, w).generate([p], {"max_tokens": 12})[0].token_ids for p in prompts]
    eng = tiny_engine(args, w, scheduler={"chunk_size": 3, "max_num_batched_tokens": 10})
    batched = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 12})]
    assert batched == solo
    assert all(len(t) == 12 for t in solo)
