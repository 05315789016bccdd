"""End to end through Ray actors: scheduler + 2 TP target workers + 1 draft worker over gRPC."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from mtpserve.cluster.distributed.build import build_engine
from mtpserve.cluster.engine.errors import WorkerUnavailableError
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import free_port
from tests.helpers.tiny import mimic_target, random_prompts, save_mimic, tiny_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return save_mimic(tmp_path_factory.mktemp("mimic"))


def dist_config(model: tuple[str, str], placement: str = "separate", **sched: int) -> MTPServeConfig:
    return MTPServeConfig.from_dict(
        {
            "model": {"path": model[0], "device": "cpu", "dtype": "float32"},
            "scheduler": {"num_kv_blocks": 256, "block_size": 8, "max_num_requests": 8, **sched},
            "speculative": {"draft": model[1], "num_draft_tokens": 3},
            "parallel": {"tp_size": 2, "draft_placement": placement},
        }
    )


RESTORE_S = 150  # new worker actors import torch and build the model; beside the image build, CI's two cores took >60 s


def wait_serving(client: MTPServeClient, timeout: float = RESTORE_S) -> None:
    """Poll health until SERVING; fails the test after `timeout` seconds (the workers were not restored)."""
    deadline = time.monotonic() + timeout
    while client.health() != "SERVING":
        assert time.monotonic() < deadline, "workers were not restored"
        time.sleep(1.0)


def reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    args, w = mimic_target()
    return [c.token_ids for c in tiny_engine(args, w).generate(prompts, {"max_tokens": max_tokens})]


def test_actors_match_single_process_and_keep_draft_kv_invariant(ray_local, model) -> None:
    prompts = random_prompts(4, 96, [23, 1, 37, 9], seed=13)
    ref = reference(prompts, 20)
    eng = build_engine(dist_config(model, chunk_size=4, max_num_batched_tokens=32))
    try:
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 20})] == ref
        assert 0 < eng.totals.accepted < eng.totals.drafted
        eng.scheduler.cfg.chunk_size = 512
        hits = eng.scheduler.prefix_hit_tokens
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 20})] == ref, "with prefix-cache hits"
        assert eng.scheduler.prefix_hit_tokens - hits >= 16 + 32, "the 23- and 37-token prompts hit 2 and 4 blocks"
        cached = prefill_kv(eng, prompts[2], 3)
        eng.scheduler.prefix_caching = False
        kv = {chunk: prefill_kv(eng, prompts[2], chunk) for chunk in (3, 512)}
        assert (kv[3] - kv[512]).abs().max().item() <= 1e-5
        assert (cached - kv[512]).abs().max().item() <= 1e-5
        hops = eng.target.hops  # type: ignore[attr-defined]
        assert hops["draft_inputs_bytes"] > 0 and hops["plan_bytes"] > 0
    finally:
        eng.shutdown()


def prefill_kv(eng: LLMEngine, prompt: list[int], chunk: int) -> torch.Tensor:
    import ray

    eng.scheduler.cfg.chunk_size = chunk
    rid = eng.add_request(prompt, {"max_tokens": 50})
    req = eng.scheduler.requests[rid]
    while req.in_context:
        eng.step()
    group = eng.target.group  # type: ignore[attr-defined]
    kv = ray.get(group.draft.draft_kv.remote(req.block_ids, len(prompt)))
    eng.abort(rid)
    return kv


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_draft_trees_through_actors(ray_local, model, placement: str) -> None:
    """Trees travel in the plans to every rank and back from the draft worker: same tokens as target-only."""
    prompts = random_prompts(3, 96, [15, 4, 30], seed=15)
    cfg = dist_config(model, placement, chunk_size=5)
    cfg.speculative.tree_budget, cfg.speculative.tree_width = 8, 3
    eng = build_engine(cfg)
    try:
        assert eng.scheduler.k == 8, "proposals are trees of 8 nodes"
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 16})] == reference(prompts, 16)
        assert 0 < eng.totals.accepted < eng.totals.drafted
    finally:
        eng.shutdown()


def test_colocated_draft_matches(ray_local, model) -> None:
    prompts = random_prompts(3, 96, [15, 4, 30], seed=14)
    eng = build_engine(dist_config(model, "colocated", chunk_size=5))
    try:
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 16})] == reference(prompts, 16)
        assert eng.totals.accepted > 0
        ruled = {"max_tokens": 16, "frequency_penalty": 0.7, "logit_bias": {5: 3.0}, "min_tokens": 4, "logprobs": 3}
        args, w = mimic_target()
        ref = tiny_engine(args, w).generate(prompts, ruled)
        got = eng.generate(prompts, ruled)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref], "logit rules travel in the plans"
        for a, b in zip(got, ref, strict=True):
            assert a.logprobs is not None and b.logprobs is not None
            assert a.logprobs.top_token_ids == b.logprobs.top_token_ids
            assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-4)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("victim", ["draft", "target-rank-1"])
def test_killed_worker_fails_requests_fast_then_recovers(ray_local, model, victim: str) -> None:
    cfg = dist_config(model, chunk_size=8)
    cfg = cfg.model_copy(
        update={"server": cfg.server.model_copy(update={"host": "127.0.0.1", "port": 0, "metrics_port": 0})}
    )
    eng = build_engine(cfg)
    server = MTPServer(eng, cfg, metrics=False)
    server.start()
    group = eng.target.group  # type: ignore[attr-defined]
    try:
        with MTPServeClient(server.address, timeout=60) as client:
            assert client.health() == "SERVING"
            prompts = random_prompts(2, 96, [12, 20], seed=15)
            for p in prompts:  # their blocks stay cached; the restarted workers do not hold that KV
                client.generate(token_ids=p, max_tokens=12)
            load = StreamLoad(client, LOAD_STREAMS)
            assert load.wait_running(8, 60), "the running slots never filled"
            actor = group.draft if victim == "draft" else group.targets[1]
            killed_at = time.monotonic()
            ray_local.kill(actor, no_restart=False)
            ends = load.join(30)
            assert set(ends) == {grpc.StatusCode.UNAVAILABLE}, ends
            assert max(load.ended) - killed_at < 5.0, "every stream (running or queued) ends within 5 s"
            assert all("worker" in d for d in load.details)
            assert client.health() == "NOT_SERVING"
            wait_serving(client)
            got = [client.generate(token_ids=p, max_tokens=12)["token_ids"] for p in prompts]
            assert got == reference(prompts, 12)
            stats = client.stats()
            assert stats["kv_blocks_used"] == 0
            assert stats["prefix_cache_hit_tokens"] < 8, "no hits on blocks the dead workers held"
    finally:
        server.stop()
        eng.shutdown()


LOAD_STREAMS = 24  # 8 running slots and 16 queued requests when a fault hits


class StreamLoad:
    """`n` concurrent long streams from threads; records how and when each ends."""

    def __init__(self, client: MTPServeClient, n: int) -> None:
        self.started: list[bool] = [False] * n
        self.codes: list[object] = [None] * n
        self.details: list[str] = [""] * n
        self.ended: list[float] = [0.0] * n
        self.threads = [threading.Thread(target=self._consume, args=(client, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _consume(self, client: MTPServeClient, i: int) -> None:
        try:
            for _chunk in client.stream(token_ids=[5 + i % 7, 6, 7 + i], max_tokens=400, ignore_eos=True):
                self.started[i] = True
            self.codes[i] = "finished"
        except grpc.RpcError as exc:
            self.codes[i], self.details[i] = exc.code(), exc.details() or ""
        self.ended[i] = time.monotonic()

    def wait_running(self, n: int, timeout: float) -> bool:
        """Whether at least n streams got a first chunk within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while sum(self.started) < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def join(self, timeout: float) -> list[object]:
        """Wait for every stream (none may hang); how each ended."""
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream hung"
        return self.codes


def test_stalled_worker_is_detected_by_the_step_timeout(ray_local, model) -> None:
    """Rank 1 stops (SIGSTOP: alive, answering nothing). The in-flight stream gets UNAVAILABLE once the step
    outlasts parallel.step_timeout_s, health turns NOT_SERVING, and serving resumes with fresh workers."""
    cfg = dist_config(model, "colocated", chunk_size=8)
    cfg = cfg.model_copy(
        update={
            "server": cfg.server.model_copy(update={"port": 0, "metrics_port": 0}),
            "parallel": cfg.parallel.model_copy(update={"step_timeout_s": 3.0}),
        }
    )
    eng = build_engine(cfg)
    server = MTPServer(eng, cfg, metrics=False)
    server.start()
    group = eng.target.group  # type: ignore[attr-defined]
    pid = ray_local.get(group.targets[1].ready.remote())
    stopped = False
    try:
        with MTPServeClient(server.address, timeout=60) as client:
            stream = client.stream(token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True)
            next(stream)
            os.kill(pid, signal.SIGSTOP)
            stopped, t0 = True, time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                for _chunk in stream:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stalled" in err.value.details() and "parallel.step_timeout_s = 3 s" in err.value.details()
            assert 2.5 < time.monotonic() - t0 < 10.0
            assert client.health() == "NOT_SERVING"
            wait_serving(client)
            prompts = random_prompts(2, 96, [12, 20], seed=16)
            got = [client.generate(token_ids=p, max_tokens=12)["token_ids"] for p in prompts]
            assert got == reference(prompts, 12)
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.stop()
        eng.shutdown()


def test_worker_unavailable_is_raised_to_the_engine(ray_local, model) -> None:
    eng = build_engine(dist_config(model, "colocated"))
    try:
        eng.add_request([1, 2, 3], {"max_tokens": 100, "ignore_eos": True})
        eng.step()
        ray_local.kill(eng.target.group.targets[0], no_restart=False)  # type: ignore[attr-defined]
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailableError):
            for _ in range(200):
                eng.step()
        assert time.monotonic() - t0 < 10
    finally:
        eng.shutdown()


def test_config_dir_exists(model) -> None:
    assert Path(model[0], "config.json").is_file()


@pytest.mark.parametrize(
    "frontends", [1, 2, 0], ids=["front-ends-in-a-child", "two-front-end-processes", "one-process"]
)
def test_scheduler_actor_serves_grpc_and_http(ray_local, model, frontends: int) -> None:
    """The scheduler actor serves gRPC and, from the same engine, the HTTP API, with its front ends in a child
    process, in two on the same ports, or in the actor itself; each gives the reference tokens."""
    from mtpserve.cluster.distributed.scheduler_actor import start_scheduler_actor, stop_scheduler_actor

    split = frontends > 0
    cfg = dist_config(model, chunk_size=6)
    server = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "http_port": 0, "engine_process": split}
    server["frontends"] = max(1, frontends)
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update=server)})
    actor, address, _, http_address = start_scheduler_actor(cfg)
    try:
        assert ray_local.get(actor.ready.remote()) is True
        actor_pid, front_end_pid = ray_local.get(actor.pids.remote())
        assert (front_end_pid is not None and front_end_pid != actor_pid) if split else front_end_pid is None
        prompts = random_prompts(2, 96, [11, 25], seed=16)
        with MTPServeClient(address, timeout=60) as client:
            assert client.health() == "SERVING"
            got = [client.generate(token_ids=p, max_tokens=10)["token_ids"] for p in prompts]
        assert got == reference(prompts, 10)
        for _ in range(6 if frontends == 2 else 0):  # new connections, spread over both front ends
            with MTPServeClient(address, timeout=60) as client:
                assert client.generate(token_ids=prompts[0], max_tokens=10)["token_ids"] == got[0]
        over_http = []
        for p in prompts:
            body = {"prompt": p, "max_tokens": 10, "return_token_ids": True}
            req = urllib.request.Request(
                f"http://{http_address}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                over_http.append(json.loads(resp.read())["choices"][0]["token_ids"])
        assert over_http == got
    finally:
        stop_scheduler_actor(actor)


@pytest.mark.parametrize("victim", ["scheduler", "front-ends"])
def test_crashed_scheduler_actor_comes_back_on_the_same_port(ray_local, model, victim: str) -> None:
    """The scheduler actor's process, or its front ends' process, dies mid-stream: the streams end with UNAVAILABLE
    within 5 s, and within 60 s the same address is SERVING again, giving the reference tokens: a new actor with new
    workers, or new front ends over the same actor and workers."""
    from mtpserve.cluster.distributed.scheduler_actor import start_scheduler_actor, stop_scheduler_actor

    cfg = dist_config(model, "colocated", chunk_size=6)
    port = free_port()
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"port": port, "metrics_port": 0})})
    before = live_groups(ray_local)
    actor, address, _, _ = start_scheduler_actor(cfg)
    try:
        with MTPServeClient(address, timeout=60) as client:
            load = StreamLoad(client, LOAD_STREAMS)
            assert load.wait_running(8, 60), "the running slots never filled"
            actor_pid, front_end_pid = ray_local.get(actor.pids.remote())
            if victim == "scheduler":
                ray_local.kill(actor, no_restart=False)
            else:
                os.kill(front_end_pid, signal.SIGKILL)
            t0 = time.monotonic()
            assert set(load.join(30)) == {grpc.StatusCode.UNAVAILABLE}
            assert max(load.ended) - t0 < 5.0, "every stream (running or queued) ends within 5 s"

        def serving() -> bool:
            try:
                with MTPServeClient(address, timeout=2) as probe:
                    return probe.health() == "SERVING"
            except grpc.RpcError:
                return False

        deadline = time.monotonic() + 60
        while not serving():
            assert time.monotonic() < deadline, "the scheduler actor did not come back within 60 s"
            time.sleep(1.0)
        prompts = random_prompts(2, 96, [11, 25], seed=17)
        with MTPServeClient(address, timeout=60) as client:
            assert [client.generate(token_ids=p, max_tokens=10)["token_ids"] for p in prompts] == reference(prompts, 10)
        now_actor, now_front = ray_local.get(actor.pids.remote())
        assert now_front != front_end_pid and (now_actor == actor_pid) == (victim == "front-ends")
        assert live_groups(ray_local) == before + 1, "the crashed incarnation's placement group is removed"
    finally:
        stop_scheduler_actor(actor)
    assert live_groups(ray_local) == before


def live_groups(ray: Any) -> int:
    """Placement groups not yet removed."""
    return sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())


def test_too_few_gpus_is_a_clear_error_not_a_hang(ray_local, model) -> None:
    """Asking for GPU workers the cluster lacks fails at once, naming the settings to change."""
    from mtpserve.cluster.distributed.actors import WorkerGroup
    from mtpserve.cluster.engine.errors import PlacementError

    cfg = dist_config(model, "separate")
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": "cuda"})})

    before = live_groups(ray_local)
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"need 3 GPUs on one node.*draft_placement=colocated"):
        WorkerGroup(cfg)
    assert time.monotonic() - t0 < 5
    assert live_groups(ray_local) == before, "no placement group may be left behind"


def test_gpu_check_counts_per_node() -> None:
    """Workers are packed on one node: GPUs spread over nodes do not add up."""
    from mtpserve.cluster.distributed.actors import check_gpus, node_gpus
    from mtpserve.cluster.engine.errors import PlacementError

    nodes = [{"Alive": True, "Resources": {"GPU": 2.0}}, {"Alive": True, "Resources": {"GPU": 2.0}},
             {"Alive": False, "Resources": {"GPU": 8.0}}, {"Alive": True, "Resources": {"CPU": 4.0}}]  # fmt: skip
    assert node_gpus(nodes) == [2, 2, 0]
    check_gpus(2, node_gpus(nodes), 2, False)
    with pytest.raises(PlacementError, match="largest node has 2"):
        check_gpus(3, node_gpus(nodes), 2, True)
    with pytest.raises(PlacementError) as err:
        check_gpus(4, node_gpus(nodes), 4, False)
    assert "colocated" not in str(err.value) and "parallel.tp_size=4" in str(err.value)


@pytest.mark.parametrize(("placement", "method"), [("separate", "mtp_vanilla"), ("colocated", "mtp_eagle")])
def test_deepseek_target_with_native_mtp_through_actors(ray_local, tmp_path: Path, placement: str, method: str) -> None:
    """A DeepSeek-V3-family target over 2 TP ranks (MLA heads and experts split) with its MTP modules drafting:
    the same tokens as one process without drafting."""
    from tests.helpers.deepseek_tiny import mimic_deepseek_args, save_deepseek_dir, tiny_deepseek_weights

    args = mimic_deepseek_args()
    w = tiny_deepseek_weights(args, mimic=True)
    path = save_deepseek_dir(tmp_path / "ds", args, w)
    prompts = random_prompts(3, args.vocab_size, [15, 4, 30], seed=14)
    plain = MTPServeConfig.from_dict(
        {"model": {"path": path, "device": "cpu", "dtype": "float32"}, "speculative": {"enabled": False}}
    )
    ref = [
        c.token_ids for c in LLMEngine.from_config(plain, load_tokenizer=False).generate(prompts, {"max_tokens": 16})
    ]
    cfg = dist_config((path, "native"), placement, chunk_size=5)
    cfg.speculative.method = method  # type: ignore[assignment]
    cfg.speculative.num_draft_tokens = 2
    eng = build_engine(cfg)
    try:
        assert [c.token_ids for c in eng.generate(prompts, {"max_tokens": 16})] == ref
        assert 0 < eng.totals.accepted < eng.totals.drafted
    finally:
        eng.shutdown()
