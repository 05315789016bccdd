"""Scaling a replica set: the rule (`Scaler`) on loads, and `serve --max-replicas 2` growing under queue pressure and
shrinking back without cutting a stream."""

from __future__ import annotations

import threading

import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.replica_scaling import Scaler
from mtpserve.cluster.service.replica_set import ReplicaSet
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import wait_for, write_tiny_model


def test_the_rule_grows_under_waiting_and_shrinks_when_the_load_fits_fewer() -> None:
    s = Scaler(min_replicas=1, max_replicas=2, up_waiting=4, capacity=8, hold_s=10.0)
    assert s.want([(8, 3)]) is None and s.want([(8, 4)]) == "up"
    assert s.want([(8, 9), (8, 9)]) is None, "at the maximum"
    assert s.want([(3, 0), (1, 0)]) == "down" and s.want([(4, 1), (0, 0)]) is None and s.want([(5, 0)]) is None
    assert s.decide([(8, 5)], 0.0) is None and s.decide([(8, 5)], 9.9) is None
    assert s.decide([(8, 5)], 10.0) == "up" and s.decide([(8, 5)], 10.5) is None, "the hold starts over"
    assert s.decide([(2, 0), (0, 0)], 20.0) is None and s.decide([(8, 6), (8, 8)], 25.0) is None
    assert s.decide([(2, 0), (0, 0)], 26.0) is None and s.decide([(2, 0), (0, 0)], 35.0) is None, "broken by 25.0"
    assert s.decide([(2, 0), (0, 0)], 36.0) == "down"


@pytest.mark.slow
def test_a_set_grows_to_two_under_pressure_and_back_without_cutting_a_stream(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model, head = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "device": "cpu"},
            "speculative": {"draft": str(head), "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 256, "max_num_requests": 2},
            "server": {
                "host": "127.0.0.1", "port": 0, "metrics_port": 0,
                "replicas": 1, "max_replicas": 2, "scale_up_waiting": 2, "scale_hold_s": 0.5,
            },
        }
    )  # fmt: skip
    srv = MTPServer(None, cfg, metrics=False)
    srv.start()
    lengths: list[int] = []
    errors: list[BaseException] = []

    def stream(i: int, tokens: int) -> None:
        client = MTPServeClient(srv.address)
        try:
            lengths.append(
                len(client.generate(token_ids=[40 + i, 41, 42], max_tokens=tokens, ignore_eos=True)["token_ids"])
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    try:
        loop = srv.loop
        assert isinstance(loop, ReplicaSet) and len(loop.replicas) == 1
        first = [threading.Thread(target=stream, args=(i, 120)) for i in range(8)]  # 2 run, 6 wait
        for t in first:
            t.start()
        assert wait_for(lambda: len(loop.replicas) == 2 and 1 in loop.router.live, 90), loop.scaled
        second = [threading.Thread(target=stream, args=(10 + i, 120)) for i in range(6)]
        for t in second:
            t.start()
        for t in first + second:
            t.join(300)
        assert errors == [] and lengths == [120] * 14, (errors, lengths)
        assert loop.counts.by_replica[1] > 0, loop.counts  # the added replica took some of the second wave
        assert wait_for(lambda: loop.parked == {1}, 60), loop.scaled  # idle again: back to one replica
        assert loop.scaled == [("up", 1), ("down", 1)]
        client = MTPServeClient(srv.address)
        try:
            assert len(client.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)["token_ids"]) == 4
        finally:
            client.close()
    finally:
        srv.stop(grace=0.0)
