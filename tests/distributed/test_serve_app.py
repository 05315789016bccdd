"""`mtpserve serve` as a Ray Serve application (cluster/cli/serve_app.py, what the RayService manifest runs), on a
local Ray cluster: the deployment comes up serving gRPC with one local engine's greedy tokens, says where its APIs
are, stays healthy, and stops the server when the application is deleted; bad args are refused by name."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mtpserve.cluster.service.client import MTPServeClient
from mtpserve.cluster.service.front_end_pool import FrontEndPool
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import free_port
from tests.helpers.tiny import save_mimic

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8]


def _config(model: tuple[str, str], server: dict[str, Any]) -> MTPServeConfig:
    return MTPServeConfig.from_dict(
        {
            "model": {"path": model[0], "device": "cpu", "dtype": "float32"},
            "scheduler": {"num_kv_blocks": 256, "block_size": 8, "max_num_requests": 8},
            "speculative": {"draft": model[1], "num_draft_tokens": 3},
            "parallel": {"tp_size": 1, "draft_placement": "colocated"},
            "server": {"host": "127.0.0.1", "metrics_port": 0, "frontends": 1, **server},
        }
    )


def test_the_application_serves_like_serve_and_stops_with_it(ray_local: Any, tmp_path: Path) -> None:
    from ray import serve

    from mtpserve.cluster.cli.serve_app import app, port_answers

    model = save_mimic(tmp_path / "mimic")
    port, http_port = free_port(), free_port()
    path = tmp_path / "cfg.yaml"
    path.write_text(_config(model, {"port": port, "http_port": http_port}).model_dump_json())
    serve.start(http_options={"location": "NoServer"})  # the test needs no Serve proxy (nor its default port)
    try:
        handle = serve.run(app({"argv": ["--config", str(path)]}), name="mtpserve", route_prefix=None)
        where = handle.endpoints.remote().result(timeout_s=60)
        assert where == {"grpc": f"127.0.0.1:{port}", "http": f"127.0.0.1:{http_port}", "serving": True}
        assert serve.status().applications["mtpserve"].status == "RUNNING"
        with MTPServeClient(where["grpc"]) as client:
            got = client.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True)["token_ids"]
        serve.delete("mtpserve")
        deadline = time.monotonic() + 60
        while port_answers("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not port_answers("127.0.0.1", port), "the server still serves after the application was deleted"
    finally:
        serve.shutdown()
    one = FrontEndPool(_config(model, {"port": 0}), 1)
    try:
        with MTPServeClient(one.address) as client:
            assert got == client.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True)["token_ids"]
    finally:
        one.stop(timeout=10.0)


def test_bad_application_args_are_refused_by_name(ray_local: Any) -> None:
    from mtpserve.cluster.cli.serve_app import app, config_of

    with pytest.raises(ValueError, match=r"args\.argv must be a list of strings"):
        app({"argv": "--port 50051"})
    with pytest.raises(ValueError, match=r"args\.endpoint_resource"):
        app({"argv": [], "endpoint_resource": 5})
    with pytest.raises(ValueError, match=r"args\.argv: give --port"):
        config_of(["--device", "cpu", "--port", "0"])
    with pytest.raises(ValueError, match=r"args\.argv: not valid"):
        config_of(["--no-such-flag"])
