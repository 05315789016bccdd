"""Logprobs, penalties, logit bias, min_tokens and min_p through `mtpserve serve`, called with the official `openai`
client and the gRPC client, with speculation on and off, against a recomputation from HF transformers' logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import yaml

from mtpserve.cluster.service.client import MTPServeClient
from tests.helpers.logit_reference import Reference
from tests.helpers.service import ServeProcess, write_tiny_model

SERVER_YAML = {
    "model": {"device": "cpu", "dtype": "float32"},
    "scheduler": {"max_num_requests": 16, "num_kv_blocks": 256, "block_size": 16},
}
PROMPTS = [[101, 2045, 388, 7, 912, 33], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
RULES: dict[str, Any] = {"frequency_penalty": 0.9, "presence_penalty": 0.4, "logit_bias": {"44": 7.5, "45": -100.0}}
EXTRA_RULES: dict[str, Any] = {"repetition_penalty": 1.4, "min_tokens": 6}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]) -> Reference:
    return Reference.from_dir(tiny[0])


@pytest.fixture(scope="module", params=["speculative", "target-only"])
def served(
    request: pytest.FixtureRequest, tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServeProcess, openai.OpenAI, MTPServeClient]]:
    config = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVER_YAML))
    args = ["--config", str(config), "--model", str(tiny[0]), "--http-port", "0"]
    args += ["--draft", str(tiny[1])] if request.param == "speculative" else ["--no-speculation"]
    proc = ServeProcess(args).start()
    client = openai.OpenAI(base_url=f"{proc.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with MTPServeClient(proc.address, timeout=60) as grpc_client:
        yield proc, client, grpc_client
    assert proc.stop() == 0, proc.log


def _model(proc: ServeProcess) -> str:
    return Path(proc.cmd[proc.cmd.index("--model") + 1]).name


def test_completion_logprobs_equal_a_recomputation(served: Any, reference: Reference) -> None:
    proc, client, grpc_client = served
    for prompt in PROMPTS:
        done = client.completions.create(
            model=_model(proc), prompt=prompt, max_tokens=12, logprobs=3, extra_body={"return_token_ids": True}
        )
        choice = done.choices[0]
        ids = choice.token_ids  # type: ignore[attr-defined]
        lp = choice.logprobs
        assert lp is not None and len(lp.token_logprobs) == len(ids) == 12
        for i, tok in enumerate(ids):
            want = torch.log_softmax(reference.logits(prompt + ids[:i]), -1)
            assert lp.token_logprobs[i] == pytest.approx(float(want[tok]), abs=2e-4)
            values = want.topk(3).values
            assert list(lp.top_logprobs[i].values()) == pytest.approx(values.tolist(), abs=2e-4)
            assert lp.tokens[i] == reference_text(proc, tok)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        streamed = client.completions.create(model=_model(proc), prompt=prompt, max_tokens=12, logprobs=3, stream=True)
        parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
        # (adaptive steps verify the same token in rows of other shapes: float sums may differ in the last bits)
        assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
        assert [o for p in parts for o in p.text_offset] == lp.text_offset
        over_grpc = grpc_client.generate(token_ids=prompt, max_tokens=12, logprobs=3)
        assert over_grpc["token_ids"] == ids
        assert [e["logprob"] for e in over_grpc["logprobs"]] == pytest.approx(lp.token_logprobs, abs=1e-5)
        assert [[t for t, _ in e["top"]] for e in over_grpc["logprobs"]] == [
            reference.logits(prompt + ids[:i]).topk(3).indices.tolist() for i in range(12)
        ]


def reference_text(proc: ServeProcess, token_id: int) -> str:
    from transformers import AutoTokenizer

    tok = _TOKENIZERS.get(proc.address)
    if tok is None:
        tok = _TOKENIZERS[proc.address] = AutoTokenizer.from_pretrained(proc.cmd[proc.cmd.index("--model") + 1])
    return str(tok.decode([token_id]))


_TOKENIZERS: dict[str, Any] = {}


def test_chat_logprobs_are_the_chosen_tokens_with_their_alternatives(served: Any) -> None:
    proc, client, _ = served
    messages = [{"role": "user", "content": "Name three colours."}]
    done = client.chat.completions.create(
        model=_model(proc), messages=messages, max_tokens=10, logprobs=True, top_logprobs=4
    )
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == done.usage.completion_tokens == 10  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token, "greedy: the chosen token is the most likely"
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []) == entry.token.encode("utf-8")
    assert "".join(e.token for e in content) == done.choices[0].message.content
    stream = client.chat.completions.create(
        model=_model(proc), messages=messages, max_tokens=10, logprobs=True, top_logprobs=4, stream=True
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)  # prefix-cache hit
    plain = client.chat.completions.create(model=_model(proc), messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_penalties_equal_the_plain_torch_reference(served: Any, reference: Reference) -> None:
    proc, client, grpc_client = served
    rules = {**RULES, **EXTRA_RULES, "max_tokens": 16}
    engine_rules = {**rules, "logit_bias": {int(k): v for k, v in RULES["logit_bias"].items()}}
    changed = 0
    for prompt in PROMPTS:
        want = reference.greedy(prompt, engine_rules, [2])
        done = client.completions.create(
            model=_model(proc),
            prompt=prompt,
            max_tokens=16,
            **RULES,
            extra_body={"return_token_ids": True, **EXTRA_RULES},
        )
        assert done.choices[0].token_ids == want  # type: ignore[attr-defined]
        assert grpc_client.generate(token_ids=prompt, **engine_rules)["token_ids"] == want
        plain = grpc_client.generate(token_ids=prompt, max_tokens=16)["token_ids"]
        changed += plain != want
    assert changed, "the rules must change what greedy decoding emits"


def test_min_p_and_stop_strings_over_grpc(served: Any, reference: Reference) -> None:
    grpc_client = served[2]
    prompt = PROMPTS[1]
    out = grpc_client.generate(token_ids=prompt, max_tokens=12, temperature=1.3, min_p=0.6, seed=9)
    for i, tok in enumerate(out["token_ids"]):
        probs = torch.softmax(reference.logits(prompt + out["token_ids"][:i]) / 1.3, -1)
        assert probs[tok] >= 0.6 * probs.max() - 1e-6
    full = grpc_client.generate(token_ids=prompt, max_tokens=20)
    stop = full["text"][10:14]
    cut = grpc_client.generate(token_ids=prompt, max_tokens=20, stop=[stop])
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].index(stop)]
    assert len(cut["token_ids"]) < len(full["token_ids"])
    kept = grpc_client.generate(token_ids=prompt, max_tokens=20, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == full["text"][: full["text"].index(stop) + len(stop)]


def test_n_choices_equal_single_requests_and_share_the_prompts_blocks(served: Any) -> None:
    proc, client, grpc_client = served
    prompt = list(range(300, 345))  # 45 tokens: two full 16-token blocks the siblings can reuse
    # temperature 0.5: the tiny model is nearly flat, and a batch of 3 rounds its logits unlike a batch of 1
    asked = {"max_tokens": 10, "temperature": 0.5, "seed": 11, "extra_body": {"return_token_ids": True}}
    hits = grpc_client.stats()["prefix_cache_hit_tokens"]
    done = client.completions.create(model=_model(proc), prompt=prompt, n=4, **asked)  # type: ignore[arg-type]
    assert grpc_client.stats()["prefix_cache_hit_tokens"] - hits >= 3 * 32, "choices 1-3 reuse the prompt's blocks"
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    alone = []
    for i in range(4):
        single = client.completions.create(model=_model(proc), prompt=prompt, **{**asked, "seed": 11 + i})  # type: ignore[arg-type]
        alone.append(single.choices[0].token_ids)  # type: ignore[attr-defined]
    assert [c.token_ids for c in done.choices] == alone  # type: ignore[attr-defined]
    assert len({tuple(a) for a in alone}) > 1, "different seeds must sample differently"
    assert done.usage is not None and done.usage.completion_tokens == 40 and done.usage.prompt_tokens == 45
    stream = client.completions.create(model=_model(proc), prompt=prompt, n=4, stream=True, **asked)  # type: ignore[arg-type]
    streamed: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)  # type: ignore[attr-defined]
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [streamed[i] for i in range(4)] == alone and reasons == dict.fromkeys(range(4), "length")
    chat = client.chat.completions.create(
        model=_model(proc), messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6, temperature=0.0
    )
    texts = [c.message.content for c in chat.choices]
    assert len(texts) == 3 and len(set(texts)) == 1, "greedy choices agree"
    stats = grpc_client.stats()
    assert stats["requests_running"] == 0 and stats["kv_blocks_used"] == 0


def test_n_completions_over_grpc(served: Any) -> None:
    grpc_client = served[2]
    prompt = list(range(400, 440))
    both = grpc_client.generate(token_ids=prompt, n=3, max_tokens=8, temperature=0.5, seed=21, logprobs=1)
    alone = [grpc_client.generate(token_ids=prompt, max_tokens=8, temperature=0.5, seed=21 + i) for i in range(3)]
    assert [c["token_ids"] for c in both["choices"]] == [a["token_ids"] for a in alone]
    assert all(len(c["logprobs"]) == 8 and c["finish_reason"] == "length" for c in both["choices"])
    with pytest.raises(Exception, match="n: at most 16"):
        grpc_client.generate(token_ids=prompt, n=17, max_tokens=2)
    assert grpc_client.stats()["kv_blocks_used"] == 0


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_structured_outputs_over_http_and_grpc(served: Any) -> None:
    import json

    import jsonschema

    proc, client, grpc_client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Who are you?"}]
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model=_model(proc), messages=messages, max_tokens=80, temperature=temperature, seed=3, response_format=fmt
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    picked = client.completions.create(
        model=_model(proc),
        prompt="Pick:",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert picked.choices[0].text in ("red", "blue") and picked.choices[0].finish_reason == "stop"
    over_grpc = grpc_client.generate("Who?", max_tokens=80, json_schema=json.dumps(SCHEMA), temperature=1.0, seed=8)
    jsonschema.validate(json.loads(over_grpc["text"]), SCHEMA)
    assert grpc_client.generate("Code?", max_tokens=10, regex="[A-Z]{3}-[0-9]{2}")["text"].count("-") == 1
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=_model(proc),
            messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert bad.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(Exception, match=r"sampling\.regex"):
        grpc_client.generate("x", max_tokens=4, regex="(unclosed")
    assert grpc_client.stats()["kv_blocks_used"] == 0


def test_tools_on_a_template_without_them_are_refused(served: Any) -> None:
    proc, client, _ = served
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=_model(proc), messages=[{"role": "user", "content": "x"}], tools=[tool])  # type: ignore[list-item]
    assert bad.value.body["param"] == "tools"  # type: ignore[index]


def test_stop_string_kept_over_http(served: Any) -> None:
    proc, client, _ = served
    prompt = PROMPTS[0]
    full = client.completions.create(model=_model(proc), prompt=prompt, max_tokens=20).choices[0].text
    stop = full[8:12]
    extra = {"include_stop_str_in_output": True}
    kept = client.completions.create(model=_model(proc), prompt=prompt, max_tokens=20, stop=[stop], extra_body=extra)
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"


def test_echo_returns_the_prompt_before_the_completion(served: Any) -> None:
    proc, client, _ = served
    alone = client.completions.create(model=_model(proc), prompt="Once upon a time", max_tokens=6).choices[0].text
    echoed = client.completions.create(model=_model(proc), prompt="Once upon a time", max_tokens=6, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + alone
    stream = client.completions.create(
        model=_model(proc), prompt="Once upon a time", max_tokens=6, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Once upon a time" + alone
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(proc.cmd[proc.cmd.index("--model") + 1])
    by_ids = client.completions.create(model=_model(proc), prompt=PROMPTS[0], max_tokens=4, echo=True)
    assert by_ids.choices[0].text.startswith(tok.decode(PROMPTS[0]))
