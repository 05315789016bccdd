"""Bad requests fail with the field named; other requests in the same engine still finish."""

from __future__ import annotations

from typing import Any

import pytest

from mtpserve.cluster.engine.errors import InvalidRequestError, QueueFullError
from tests.helpers.tiny import tiny_args, tiny_engine, tiny_weights

BAD: list[tuple[str, list[int], dict[str, Any], str]] = [
    ("empty prompt", [], {}, "prompt"),
    ("prompt too long", [1] * 600, {}, "prompt"),
    ("token id outside vocabulary", [1, 2, 96], {}, "prompt_token_ids"),
    ("negative token id", [-1], {}, "prompt_token_ids"),
    ("max_tokens zero", [1, 2], {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", [1, 2], {"max_tokens": -3}, "max_tokens"),
    ("temperature negative", [1, 2], {"temperature": -0.5}, "temperature"),
    ("top_p zero", [1, 2], {"top_p": 0.0}, "top_p"),
    ("top_p above one", [1, 2], {"top_p": 1.5}, "top_p"),
    ("unknown field", [1, 2], {"beam_width": 2}, "beam_width"),
    ("stop token outside vocabulary", [1, 2], {"stop_token_ids": [500]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("name", "prompt", "params", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_field_and_others_finish(name: str, prompt: list[int], params: dict, field: str) -> None:
    args = tiny_args()
    eng = tiny_engine(args, tiny_weights(args))
    good = eng.add_request([3, 4, 5], {"max_tokens": 6})
    for _ in range(2):
        eng.step()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(prompt, params)
    assert err.value.field == field
    assert field in str(err.value) and err.value.reason
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished[good].num_output_tokens == 6
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_queue_bound_is_enforced() -> None:
    args = tiny_args()
    eng = tiny_engine(args, tiny_weights(args), scheduler={"max_queue": 2})
    eng.add_request([1], {"max_tokens": 2})
    eng.add_request([1], {"max_tokens": 2})
    with pytest.raises(QueueFullError):
        eng.add_request([1], {"max_tokens": 2})


def test_request_larger_than_cache_is_refused() -> None:
    args = tiny_args()
    eng = tiny_engine(args, tiny_weights(args), scheduler={"num_kv_blocks": 4})
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([1] * 10, {"max_tokens": 200})
    assert err.value.field == "max_tokens"


def test_temperatures_below_the_floor_decode_greedily() -> None:
    """A temperature of 1e-40 would overflow the scaled logits to inf and the probabilities to NaN: below
    MIN_TEMPERATURE it decodes greedily, token for token as temperature 0."""
    from mtpserve.cluster.engine.sampling_params import MIN_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    args = tiny_args()
    weights = tiny_weights(args)
    greedy = tiny_engine(args, weights).generate([[3, 4, 5]], {"max_tokens": 8})[0].token_ids
    tiny = tiny_engine(args, weights).generate([[3, 4, 5]], {"max_tokens": 8, "temperature": 1e-40, "seed": 1})
    assert tiny[0].token_ids == greedy
