"""`mtpserve serve --frontends 2`: two front-end processes on the same ports beside the engine's process.

256 openai-client streams (some closed mid-stream) end right and greedy ones equal the same request alone; every
KV block is free afterwards; the token check holds on every front end; /metrics is one view whose request count
equals the requests sent; a front end killed under load is replaced while the other one's streams finish.
"""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import psutil
import pytest
import yaml

from mtpserve.cluster.service.client import MTPServeClient
from tests.helpers.openai_streams import CANCELLED_MAX_TOKENS, MAX_TOKENS, STREAMS, Spec, one_round, plan
from tests.helpers.service import ServeProcess, wait_for, write_tiny_model

TOKEN = "pool-secret-token"
SERVER_YAML = {
    "model": {"device": "cpu", "dtype": "float32"},
    "scheduler": {"max_num_requests": 64, "max_queue": 1024, "num_kv_blocks": 1024, "block_size": 16},
    "server": {"frontends": 2},
}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A speculative tiny-model server (SmolLM2's tokenizer), two front ends, a bearer token, HTTP on."""
    model, head = write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    cfg_dir = tmp_path_factory.mktemp("cfg")
    (cfg_dir / "token").write_text(TOKEN)
    config = cfg_dir / "serve.yaml"
    config.write_text(yaml.safe_dump(SERVER_YAML))
    args = ["--config", str(config), "--model", str(model), "--draft", str(head), "--http-port", "0"]
    proc = ServeProcess([*args, "--auth-token-file", str(cfg_dir / "token")], startup_timeout=240)
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log


def front_end_pids(server: ServeProcess) -> set[int]:
    """Processes under the server that listen on its gRPC port."""
    assert server.proc is not None
    pids = set()
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            conns = child.net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == server.port for c in conns):
            pids.add(child.pid)
    return pids


def loads_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped."""
    return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps())


def metrics_text(server: ServeProcess) -> str:
    """What the one /metrics endpoint shows."""
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()


def requests_counted(server: ServeProcess) -> float:
    """mtpserve_requests_total summed over front ends and reasons, from the one /metrics endpoint."""
    text = metrics_text(server)
    return sum(float(m[1]) for m in re.finditer(r"^mtpserve_requests_total\{[^}]*\} (\S+)$", text, re.M))


def idle(client: MTPServeClient) -> dict[str, Any]:
    """The engine's state once nothing runs or waits and no KV block is held."""
    return wait_for(
        lambda: (s := client.stats())["kv_blocks_used"] == 0 and s["requests_running"] == 0 and s, timeout=60
    )


def model_id(server: ServeProcess) -> str:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    return client.models.list().data[0].id


def test_two_front_ends_listen_and_check_the_token(server: ServeProcess) -> None:
    """Two processes hold the ports, each (and the engine's) with its start-up heap frozen, and neither they nor the
    serving process that started them loads torch (the engine does); calls without the token are refused, however
    the kernel spreads them."""
    assert server.proc is not None
    front_ends = front_end_pids(server)
    assert len(front_ends) == 2
    assert not any(loads_torch(pid) for pid in [*front_ends, server.proc.pid])
    assert any(loads_torch(c.pid) for c in psutil.Process(server.proc.pid).children(recursive=True))
    for who in ("engine process", "front end 0", "front end 1"):  # each froze its start-up heap
        assert re.search(rf"{who}: [1-9][0-9]* start-up objects frozen", server.log), server.log[-3000:]
    for _ in range(24):  # a new connection each: both front ends answer some
        refused = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            refused.models.list()
        refused.close()
    assert model_id(server)


def test_256_streams_over_two_front_ends(server: ServeProcess) -> None:
    specs = plan(seed=1)
    cancelled = sum(s.cancel for s in specs)
    base_url = f"{server.http_url}/v1"
    model = model_id(server)
    with MTPServeClient(server.address, timeout=60, auth_token=TOKEN) as grpc_client:
        counted_before = requests_counted(server)
        outcomes = asyncio.run(one_round(base_url, model, specs, api_key=TOKEN))
        wrong = []
        for i, (spec, out) in enumerate(zip(specs, outcomes, strict=True)):
            if spec.cancel:
                if not (out.closed_early and out.tokens):
                    wrong.append(f"{i}: cancel planned, got {out}")
            elif not (out.finish == "length" and len(out.tokens) == MAX_TOKENS and out.usage.completion_tokens == 6):
                wrong.append(f"{i}: {out}")
        assert not wrong, "\n".join(wrong[:10])
        idle(grpc_client)
        assert wait_for(lambda: requests_counted(server) - counted_before == STREAMS, timeout=30)
        assert re.search(r"^mtpserve_model_info\{[^}]*model_name=", metrics_text(server), re.M), "one model_info"
    text = metrics_text(server)  # the engine-wide gauges once, from the engine's state: nothing held now
    assert re.findall(r"^mtpserve_kv_blocks_used (\S+)$", text, re.M) == ["0.0"], text
    assert len(re.findall(r"^# TYPE mtpserve_requests_running gauge$", text, re.M)) == 1
    assert 10 <= cancelled <= 60 and CANCELLED_MAX_TOKENS > MAX_TOKENS
    alone = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=60)
    greedy = [(s, o) for s, o in zip(specs, outcomes, strict=True) if not s.cancel and not s.sampling.get("seed")]
    for spec, out in greedy[:12]:
        assert rerun_alone(alone, model, spec) == out.tokens, spec


def rerun_alone(client: openai.OpenAI, model: str, spec: Spec) -> list[int]:
    """The greedy tokens of `spec` as a request of its own."""
    kw: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    if spec.chat:
        got: Any = client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}], **kw)
    else:
        got = client.completions.create(prompt=spec.prompt, **kw)
    return list(got.choices[0].token_ids)


async def long_streams(base_url: str, model: str, n: int, max_tokens: int) -> list[tuple[int, str | None]]:
    """`n` greedy streams on connections of their own: (tokens received, finish reason or the error's name)."""

    async def one(i: int) -> tuple[int, str | None]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=120)
        tokens = 0
        try:
            stream: Any = await client.completions.create(
                model=model,
                prompt=[11 + i, 12, 13],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            finish = None
            async for chunk in stream:
                for choice in chunk.choices:
                    tokens += len(choice.token_ids)
                    finish = choice.finish_reason or finish
            return tokens, finish
        except Exception as exc:
            return tokens, type(exc).__name__
        finally:
            await client.close()

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_killed_front_end_is_replaced_and_the_other_keeps_streaming(server: ServeProcess) -> None:
    base_url = f"{server.http_url}/v1"
    model = model_id(server)
    before = front_end_pids(server)
    assert len(before) == 2
    victim = min(before)

    async def run() -> list[tuple[int, str | None]]:
        task = asyncio.create_task(long_streams(base_url, model, 32, 200))
        await asyncio.sleep(2.0)  # the streams are under way on both front ends
        psutil.Process(victim).send_signal(signal.SIGKILL)
        return await task

    results = asyncio.run(run())
    finished = [r for r in results if r == (200, "length")]
    cut = [r for r in results if r[1] != "length"]
    assert finished and cut, results  # the other front end's streams finished; the victim's were cut
    assert len(finished) + len(cut) == 32 and all(r[0] < 200 for r in cut), results
    after = wait_for(lambda: (p := front_end_pids(server)) and len(p) == 2 and victim not in p and p, timeout=120)
    assert len(after & before) == 1
    with MTPServeClient(server.address, timeout=60, auth_token=TOKEN) as grpc_client:
        idle(grpc_client)  # the dead front end's requests were aborted: their blocks are free
    alone = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=60)
    for i in range(8):  # new requests succeed, on both front ends
        got = alone.completions.create(model=model, prompt=[5, 6, i + 7], max_tokens=4, temperature=0)
        assert got.choices[0].finish_reason == "length"
        alone.close()
        alone = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=60)
    assert server.proc is not None and server.proc.poll() is None


def test_front_ends_over_an_engine_of_this_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The Ray scheduler actor's arrangement: the engine built here, served from a thread to two front-end
    processes. The ready message carries a real tokenizer (more than a pipe holds); the pool starts and a text
    prompt completes with the same tokens as the engine alone."""
    import threading
    from functools import partial

    from mtpserve.cluster.engine.llm_engine import LLMEngine
    from mtpserve.cluster.service.engine_child import EngineThread
    from mtpserve.cluster.service.front_end_pool import FrontEndPool
    from mtpserve.workers.config import MTPServeConfig

    model, head = write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    cfg = MTPServeConfig.from_dict(
        SERVER_YAML,
        {
            "model.path": str(model),
            "speculative.draft": str(head),
            "server.port": 0,
            "server.http_port": 0,
            "server.metrics_port": 0,
        },
    )
    alone = LLMEngine.from_config(cfg)
    ids = alone.encode_prompt("Once upon a time", chat=False)
    (want,) = alone.generate([ids], {"max_tokens": 8, "ignore_eos": True})
    alone.shutdown()
    engine = LLMEngine.from_config(cfg)
    started: list[Any] = []
    local = partial(EngineThread, engine)
    starter = threading.Thread(target=lambda: started.append(FrontEndPool(cfg, 2, local_engine=local)), daemon=True)
    starter.start()
    starter.join(180)
    assert started, "the pool did not start within 180 s"
    pool = started[0]
    try:
        client = openai.OpenAI(base_url=f"http://{pool.http_address}/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(
            model=client.models.list().data[0].id,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert done.choices[0].token_ids == want.token_ids
        assert pool.routes_relayed == 0, "one engine: the front ends share no routes through this process"
    finally:
        pool.stop()
        engine.shutdown()
