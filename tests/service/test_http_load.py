"""256 concurrent streams from the openai async client against `mtpserve serve --http-port` on loopback, some
closed mid-stream: every stream ends right, and every KV block is free afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import yaml

from mtpserve.cluster.service.client import MTPServeClient
from tests.helpers.openai_streams import CANCELLED_MAX_TOKENS, MAX_TOKENS, STREAMS, one_round, plan
from tests.helpers.service import ServeProcess, wait_for, write_tiny_model

RERUN_ALONE = 16  # greedy streams checked against the same request run alone
SERVER_YAML = {
    "model": {"device": "cpu", "dtype": "float32"},
    "scheduler": {"max_num_requests": 64, "max_queue": 1024, "num_kv_blocks": 1024, "block_size": 16},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A speculative tiny-model server with SmolLM2's tokenizer, 64 running slots, the HTTP API on."""
    model, head = write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    config = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVER_YAML))
    proc = ServeProcess(["--config", str(config), "--model", str(model), "--draft", str(head), "--http-port", "0"])
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log


@pytest.mark.slow
def test_256_concurrent_streams_end_right_and_free_every_block(server: ServeProcess) -> None:
    """Each stream closed early got tokens first, and its request stopped far short of its max_tokens; every
    other one ends with finish_reason "length", its MAX_TOKENS tokens and a final usage chunk that counts
    them; greedy ones equal the same request run alone; afterwards nothing runs or waits and every KV block
    is free."""
    specs = plan(seed=0)
    cancelled = sum(s.cancel for s in specs)
    assert 10 <= cancelled <= 60
    base_url = f"{server.http_url}/v1"
    with MTPServeClient(server.address, timeout=60) as grpc_client:
        before = grpc_client.stats()
        model = openai.OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id
        outcomes = asyncio.run(one_round(base_url, model, specs))
        wrong = []
        for i, (spec, out) in enumerate(zip(specs, outcomes, strict=True)):
            if spec.cancel:
                if not (out.closed_early and out.tokens):
                    wrong.append(f"{i}: cancel planned, got {out}")
            elif not (
                out.finish == "length"
                and len(out.tokens) == MAX_TOKENS
                and out.usage is not None
                and out.usage.completion_tokens == MAX_TOKENS
            ):
                wrong.append(f"{i}: {out}")
        assert not wrong, "\n".join(wrong[:10])
        after = wait_for(
            lambda: (s := grpc_client.stats())["kv_blocks_used"] == 0 and s["requests_running"] == 0 and s,
            timeout=60,
        )
        assert after["requests_waiting"] == 0
        assert after["requests_finished"] - before["requests_finished"] == STREAMS
        generated = after["generated_tokens"] - before["generated_tokens"]
        assert generated < (STREAMS - cancelled) * MAX_TOKENS + cancelled * CANCELLED_MAX_TOKENS // 3, generated
    greedy = [(s, o) for s, o in zip(specs, outcomes, strict=True) if not s.cancel and not s.sampling.get("seed")]
    alone = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    for spec, out in greedy[:RERUN_ALONE]:
        kw: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
        kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
        if spec.chat:
            got = alone.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}], **kw)
        else:
            got = alone.completions.create(prompt=spec.prompt, **kw)
        assert got.choices[0].token_ids == out.tokens, spec  # type: ignore[attr-defined]
