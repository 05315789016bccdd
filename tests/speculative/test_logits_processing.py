"""Logit rules (penalties, logit bias, min_tokens, min_p) and logprobs in the engine, with and without speculation,
against a plain-torch reference over HF transformers' logits for the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mtpserve.cluster.engine.errors import InvalidRequestError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.train.generators import HFGenerator
from tests.helpers.logit_reference import Reference
from tests.helpers.tiny import mimic_head, mimic_target, random_prompts, tiny_engine

SPECULATION: dict[str, dict[str, Any] | None] = {
    "target-only": None,
    "chain K=3": {"num_draft_tokens": 3},
    "tree": {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3},
}


@pytest.fixture(scope="module")
def target() -> tuple[LlamaArgs, dict[str, torch.Tensor], Reference]:
    args, w = mimic_target(seed=3)
    return args, w, Reference(HFGenerator(args, w, "cpu", torch.float32, batch_size=1).model)


def _engine(args: LlamaArgs, w: dict[str, torch.Tensor], spec: dict[str, Any] | None, **sections: Any) -> LLMEngine:
    if spec is None:
        return tiny_engine(args, w, **sections)
    return tiny_engine(args, w, mimic_head(args, w), speculative=spec, **sections)


RULES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8, "presence_penalty": -0.3},
    {"repetition_penalty": 1.7},
    {"logit_bias": {5: 6.0, 11: -100.0}, "frequency_penalty": 0.4},
]


@pytest.mark.parametrize("spec", list(SPECULATION))
def test_greedy_rules_equal_the_plain_torch_reference(target: Any, spec: str) -> None:
    args, w, ref = target
    prompts = random_prompts(3, args.vocab_size, [9, 17, 4], seed=5)
    eng = _engine(args, w, SPECULATION[spec])
    for rules in RULES:
        params = {"max_tokens": 20, **rules}
        got = [c.token_ids for c in eng.generate(prompts, params)]
        assert got == [ref.greedy(p, params) for p in prompts], rules
    plain = [c.token_ids for c in eng.generate(prompts, {"max_tokens": 20})]
    assert plain != got, "the rules must change what greedy decoding emits"
    if SPECULATION[spec] is not None:
        assert eng.totals.accepted > 0, "drafts must be accepted under the rules too"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


@pytest.mark.parametrize("spec", list(SPECULATION))
def test_min_tokens_holds_back_stop_tokens(target: Any, spec: str) -> None:
    args, w, ref = target
    prompt = random_prompts(1, args.vocab_size, [11], seed=8)[0]
    plain = _engine(args, w, None).generate([prompt], {"max_tokens": 16})[0].token_ids
    stop = plain[1]  # greedy decoding would stop at the second token
    params = {"max_tokens": 16, "min_tokens": 9, "stop_token_ids": [stop]}
    out = _engine(args, w, SPECULATION[spec]).generate([prompt], params)[0]
    expected = ref.greedy(prompt, params, [stop])
    assert out.token_ids == expected
    assert len(out.token_ids) >= 9 and stop not in out.token_ids[:8]


@pytest.mark.parametrize("spec", list(SPECULATION))
@pytest.mark.parametrize("top", [0, 4])
def test_logprobs_equal_a_recomputation_from_the_targets_logits(target: Any, spec: str, top: int) -> None:
    args, w, ref = target
    prompts = random_prompts(2, args.vocab_size, [13, 6], seed=2)
    eng = _engine(args, w, SPECULATION[spec], scheduler={"chunk_size": 5})
    for sampled in (False, True):
        params = {"max_tokens": 14, "logprobs": top, **({"temperature": 0.9, "seed": 4} if sampled else {})}
        for prompt, c in zip(prompts, eng.generate(prompts, params), strict=True):
            assert c.logprobs is not None and len(c.logprobs.token_logprobs) == len(c.token_ids) == 14
            for i, tok in enumerate(c.token_ids):
                lp = torch.log_softmax(ref.logits(prompt + c.token_ids[:i]), -1)
                assert c.logprobs.token_logprobs[i] == pytest.approx(float(lp[tok]), abs=2e-4)
                assert len(c.logprobs.top_token_ids[i]) == top
                if top:
                    values, ids = lp.topk(top)
                    assert c.logprobs.top_token_ids[i] == ids.tolist()
                    assert c.logprobs.top_logprobs[i] == pytest.approx(values.tolist(), abs=2e-4)
    if SPECULATION[spec] is not None:
        assert eng.totals.accepted > 0


@pytest.mark.parametrize("spec", ["target-only", "chain K=3"])
def test_min_p_samples_only_tokens_near_the_most_likely(target: Any, spec: str) -> None:
    args, w, ref = target
    prompts = random_prompts(4, args.vocab_size, [7, 12, 5, 9], seed=6)
    eng = _engine(args, w, SPECULATION[spec])
    params = {"max_tokens": 12, "temperature": 1.5, "min_p": 0.5, "seed": 1}
    wide = {"max_tokens": 12, "temperature": 1.5, "seed": 1}
    below = 0
    for prompt, c, free in zip(prompts, eng.generate(prompts, params), eng.generate(prompts, wide), strict=True):
        for i, tok in enumerate(c.token_ids):
            probs = torch.softmax(ref.logits(prompt + c.token_ids[:i]) / 1.5, -1)
            assert probs[tok] >= 0.5 * probs.max() - 1e-6
        for i, tok in enumerate(free.token_ids):
            probs = torch.softmax(ref.logits(prompt + free.token_ids[:i]) / 1.5, -1)
            below += int(probs[tok] < 0.5 * probs.max())
    assert below > 0, "without min_p the same sampling must pick some token it would drop"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"logit_bias": {96: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_rules_are_refused_by_name(target: Any, params: dict[str, Any], field: str) -> None:
    args, w, _ = target
    eng = _engine(args, w, None)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([1, 2, 3], {"max_tokens": 8, **params})
    assert field in str(err.value)
