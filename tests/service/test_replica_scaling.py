"""Scaling the engines: the rule (`Scaler`) on loads, and `serve --max-replicas 2` over two front ends growing under
queue pressure and shrinking back without cutting a stream."""

from __future__ import annotations

import pytest

from mtpserve.cluster.service.front_end_pool import FrontEndPool
from mtpserve.cluster.service.replica_scaling import Scaler
from mtpserve.cluster.service.server import MTPServer
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.replicas import grows_and_shrinks
from tests.helpers.service import write_tiny_model


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
def test_a_pool_grows_to_two_under_pressure_and_back_without_cutting_a_stream(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`serve --max-replicas 2 --frontends 2`: the pool adds an engine under queue pressure, both front ends route
    to it, and once idle it drains and stops it; no stream is cut (tests.helpers.replicas.grows_and_shrinks)."""
    model, head = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    cfg = MTPServeConfig.from_dict(
        {
            "model": {"path": str(model), "device": "cpu"},
            "speculative": {"draft": str(head), "num_draft_tokens": 2},
            "scheduler": {"num_kv_blocks": 256, "max_num_requests": 2},
            "server": {
                "host": "127.0.0.1", "port": 0, "metrics_port": 0, "frontends": 2,
                "replicas": 1, "max_replicas": 2, "scale_up_waiting": 2, "scale_hold_s": 0.5,
            },
        }
    )  # fmt: skip
    pool = FrontEndPool(cfg, cfg.server.num_frontends)
    try:
        grows_and_shrinks(pool)
    finally:
        pool.stop(timeout=10.0)


def test_one_server_refuses_to_scale_without_a_pool() -> None:
    """Scaling is the pool's: an MTPServer asked to scale its own engines says so by field name."""
    cfg = MTPServeConfig.from_dict({"model": {"device": "cpu"}, "server": {"replicas": 1, "max_replicas": 2}})
    with pytest.raises(ValueError, match=r"server\.max_replicas"):
        MTPServer(None, cfg, metrics=False)
