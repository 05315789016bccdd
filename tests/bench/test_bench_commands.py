"""`mtpserve bench ttft|trees|load|distributed|http-vs-grpc|serve` and `bench/gpu.py`, on tiny random models on CPU:
each writes the shared report, and what it measures holds (greedy speculation equals target-only in fp32;
every load stream ends as its fate asks and frees its KV blocks; the Ray path reports its per-hop timeline)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.probes.gemv_tiles import choose_tiles, parse_candidates
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.cli.mtpserve import main
from tests.helpers.service import ROOT, child_env, write_dummy_model

REPORT_KEYS = ("benchmark", "command", "date", "torch", "device", "dtype", "torch_threads", "settings", "results")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These runs time nothing; one thread avoids OpenMP stalls on a busy 2-core host."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A config.json-only tiny Llama for --load-format dummy."""
    return write_dummy_model(tmp_path / "model")


def dummy_flags(model: Path) -> list[str]:
    return ["--model", str(model), "--load-format", "dummy", "--draft", "random", "--device", "cpu"]


def test_trees_report_and_greedy_speculation_equal_target_only(model: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "trees.json", tmp_path / "trees.png"
    configs = "target-only,chain K=1,chain K=3,tree K=3 N=8 w=3"
    argv = ["bench", "trees", *dummy_flags(model), "--configs", configs, "--batches", "1,2", "--max-tokens", "6"]
    assert main([*argv, "--num-prompts", "2", "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert all(k in doc for k in REPORT_KEYS)
    assert doc["benchmark"] == "trees" and doc["command"].startswith("mtpserve bench trees")
    rows = doc["results"]
    assert [(r["config"], r["batch"]) for r in rows] == [(c, b) for c in configs.split(",") for b in (1, 2)]
    for r in rows:
        assert r["tok_s"] > 0 and r["step_ms"] > 0
        assert r["outputs_equal_target_only"] == 1.0, r  # fp32 greedy: drafts never change the tokens
        assert (r["acceptance_length"] is None) == (r["config"] == "target-only")
    assert [r["speedup"] for r in rows if r["config"] == "target-only"] == [1.0, 1.0]
    assert png.stat().st_size > 0


def test_trees_refuses_an_unknown_configuration(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "trees", *dummy_flags(model), "--configs", "chain K=9"])
    assert exc.value.code == 2
    assert "unknown configuration(s) ['chain K=9']" in capsys.readouterr().err


def test_ttft_rows_alone_and_busy(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", *dummy_flags(model), "--lengths", "16,40", "--ks", "0,2", "--busy", "3"]
    assert main([*argv, "--busy-tokens", "24", "--repeats", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert all(k in doc for k in REPORT_KEYS) and doc["benchmark"] == "ttft"
    rows = doc["results"]
    assert [(r["k"], r["prompt_tokens"], r["busy"]) for r in rows] == [
        (k, n, busy) for k in (0, 2) for n in (16, 40) for busy in (0, 3)
    ]
    for r in rows:
        assert len(r["ms"]) == (2 if r["busy"] == 0 else 1) and min(r["ms"]) > 0
        assert r["steps"] >= 1
    # the default chunk of 512 holds a 40-token prompt: alone, one step gives its first token
    assert all(r["steps"] == 1 for r in rows if r["busy"] == 0)


def test_load_every_stream_ends_as_planned_and_frees_its_blocks(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = ["bench", "load", *dummy_flags(model), "--streams", "24", "--rounds", "2", "--lengths", "8,16"]
    argv += ["--max-tokens", "4,8", "--vocab", "256", "--max-num-requests", "8", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert all(k in doc for k in REPORT_KEYS) and doc["benchmark"] == "load"
    for rnd in doc["results"]:
        assert rnd["wrong"] == [] and rnd["after"]["kv_blocks_used"] == 0
        assert sum(rnd["ends"].values()) == 24
        assert rnd["run_streams_finished"] == rnd["run_streams"]
    alone = doc["greedy_alone"]
    assert alone["greedy_streams"] > 0 and alone["identical"] == alone["greedy_streams"]  # fp32: exact


def test_load_refuses_a_single_max_tokens(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "load", *dummy_flags(model), "--max-tokens", "8"]) == 2
    assert "--max-tokens takes two values" in capsys.readouterr().err


def test_distributed_in_process_report(tmp_path: Path) -> None:
    out, png = tmp_path / "distributed.json", tmp_path / "distributed.png"
    argv = ["bench", "distributed", "--device", "cpu", "--shape", "tiny", "--setups", "in-process"]
    argv += [
        "--batches",
        "1,2",
        "--ks",
        "0,1",
        "--steps",
        "3",
        "--repeats",
        "2",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert all(k in doc for k in REPORT_KEYS) and doc["benchmark"] == "distributed"
    assert doc["command"].startswith("mtpserve bench distributed --device cpu")
    assert doc["errors"] == [] and len(doc["runs"]) == 2 * 2 * 2  # repeats x depths x batches
    rows = doc["results"]
    assert [(r["setup"], r["k"], r["batch"]) for r in rows] == [("in-process", k, b) for k in (0, 1) for b in (1, 2)]
    for r in rows:
        runs = [x["step_ms"] for x in doc["runs"] if (x["k"], x["batch"]) == (r["k"], r["batch"])]
        assert r["step_ms"] == min(runs) > 0 and r["vs_in_process"] == 1.0
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_distributed_ray_path_reports_its_timeline(tmp_path: Path) -> None:
    from mtpserve.cluster.bench.distributed import SEGMENTS

    out = tmp_path / "distributed.json"
    argv = ["bench", "distributed", "--device", "cpu", "--shape", "tiny", "--setups", "in-process,ray-tp1-sync"]
    assert main([*argv, "--batches", "2", "--ks", "1", "--steps", "6", "--json", str(out)]) == 0
    import ray as ray_module

    assert not ray_module.is_initialized(), "the Ray runtime the benchmark started must be shut down"
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    local, ray = doc["results"]
    assert (local["setup"], ray["setup"]) == ("in-process", "ray-tp1-sync")
    assert ray["vs_in_process"] == pytest.approx(local["step_ms"] / ray["step_ms"])
    assert sorted(ray["timeline_ms"]) == sorted(SEGMENTS) and min(ray["timeline_ms"].values()) >= 0
    # every answered step's path fits inside the step it belongs to
    assert sum(ray["timeline_ms"].values()) < 3 * ray["step_ms"]
    assert ray["hops"]["plan_bytes"] > 0 and ray["hops"]["output_bytes"] > 0
    assert local["timeline_ms"] == {} and local["hops"] == {}


def test_distributed_refuses_an_unknown_setup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "distributed", "--setups", "in-process,ray-tp3"])
    assert exc.value.code == 2
    assert "unknown setup(s) ['ray-tp3']" in capsys.readouterr().err


def test_http_vs_grpc_report_on_a_tiny_server(tmp_path: Path) -> None:
    argv = ["bench", "http-vs-grpc", "--tiny", "--device", "cpu", "--batch-sizes", "1,3", "--repeats", "1"]
    assert main([*argv, "--prompt-len", "8", "--output-len", "6", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "http_vs_grpc.json").read_text())
    assert all(k in doc for k in REPORT_KEYS) and doc["benchmark"] == "http_vs_grpc"
    assert [r["batch"] for r in doc["results"]] == [1, 3]
    for row in doc["results"]:
        for fe in ("grpc", "http"):
            assert row[fe]["errors"] == 0 and row[fe]["rounds"] == 1 and row[fe]["tok_per_s"] > 0
            assert row[fe]["ttft_ms_p50"] <= row[fe]["ttft_ms_p90"]
        assert row["http_over_grpc"]["tok_per_s"] == pytest.approx(row["http"]["tok_per_s"] / row["grpc"]["tok_per_s"])
    # a warm-up and a measured round per front end and batch size; every stream got its 6 tokens
    assert len(doc["rounds"]) == 2 * 2 * 2
    assert all(r["tokens"] == 6 * r["batch"] and r["errors"] == [] for r in doc["rounds"])


@pytest.mark.slow
def test_serve_report_on_a_tiny_server_with_two_front_ends(tmp_path: Path) -> None:
    """Engine alone and served rows at 1 and 3 streams, both APIs, one and two front ends: every row measured
    tokens, no stream failed, and `ratio` is served over engine alone."""
    argv = ["bench", "serve", "--tiny", "--device", "cpu", "--configs", "target-only", "--streams", "1,3"]
    argv += ["--frontends", "1,2", "--prompt-len", "8", "--output-len", "6", "--warmup-s", "1", "--window-s", "2"]
    assert main([*argv, "--client-procs", "2", "--json", str(tmp_path / "serve.json")]) == 0
    doc = json.loads((tmp_path / "serve.json").read_text())
    assert all(k in doc for k in REPORT_KEYS) and doc["benchmark"] == "serve"
    rows = doc["results"]
    got = {(r["frontends"], r["front_end"], r["streams"]) for r in rows}
    assert got == {(f, api, s) for f in (1, 2) for api in ("http", "grpc") for s in (1, 3)}
    for r in rows:
        assert r["errors"] == 0 and r["served_tok_s"] > 0 and r["engine_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["served_tok_s"] / r["engine_tok_s"])
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["requests_finished"] > 0 and r["server_cpu_s_per_1k_tokens_per_process"]
        assert r["engine_steps"] > 0 and r["launched_share"] == 0, "the engine's steps, all in turn on the CPU"
        assert r["rows_per_step"] >= 1
        assert r["life_p50_ms"] > r["tail_p50_ms"] >= 0, "a request's life holds its stream's end"
        assert r["engine_life_ms"] == pytest.approx(1e3 * r["streams"] * 6 / r["engine_tok_s"])
        if r["streams"] == 1:  # a step gives its one stream one token: the steps counted span the clients' window
            tokens = r["served_tok_s"] * 2
            assert abs(r["engine_steps"] - tokens) <= 0.2 * tokens + 3, (r["engine_steps"], tokens)
    assert set(doc["engine_alone"]) == {"target-only 1", "target-only 3"}
    for alone in doc["engine_alone"].values():
        assert alone["engine_steps"] > 0 and alone["launched_share"] == 0


def test_serve_without_an_api_measures_the_engine_alone_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--front-ends=` (none): the engine-alone figures, and no server started for rows nobody drives."""

    def no_server(*args: object, **kwargs: object) -> None:
        raise AssertionError("a server was started with no API to drive")

    monkeypatch.setattr(bench_report, "serve_subprocess", no_server)
    argv = ["bench", "serve", "--tiny", "--device", "cpu", "--configs", "target-only", "--streams", "1"]
    argv += ["--front-ends=", "--prompt-len", "8", "--output-len", "6", "--warmup-s", "0.5", "--window-s", "1"]
    assert main([*argv, "--json", str(tmp_path / "alone.json")]) == 0
    doc = json.loads((tmp_path / "alone.json").read_text())
    assert doc["results"] == [] and doc["engine_alone"]["target-only 1"]["engine_tok_s"] > 0


def test_serve_report_so_far_is_marked_incomplete(tmp_path: Path) -> None:
    """What `bench serve` has finished is on disk after each row, marked incomplete, so a run that a time limit
    cuts short keeps its figures."""
    from mtpserve.cluster.bench import serve as bench_serve
    from mtpserve.cluster.cli.mtpserve import build_parser

    out = tmp_path / "serve.json"
    args = build_parser().parse_args(["bench", "serve", "--tiny", "--device", "cpu", "--json", str(out)])
    row = {"config": "target-only", "front_end": "grpc", "streams": 64, "served_tok_s": 123.0}
    bench_serve.save_so_far(args, [row], None, {"target-only 64": {"engine_tok_s": 456.0}})
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["results"] == [row]
    assert doc["engine_alone"] == {"target-only 64": {"engine_tok_s": 456.0}}
    assert doc["settings"]["tiny"] is True and doc["benchmark"] == "serve"


def test_unknown_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for kind in ("ttft", "distributed", "http-vs-grpc", "serve"):
        with pytest.raises(SystemExit):
            main(["bench", kind, "--no-such-flag"])
        assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "1,x", "0,4", "-1"])
def test_int_list_names_the_bad_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}'"):
        bench_report.int_list(text)


def run_gpu_set(model: Path, out: Path, *flags: str) -> None:
    """`bench/gpu.py` on CPU with a tiny random model; fails the test with its output when it exits non-zero."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), *dummy_flags(model), "--out", str(out), *flags]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def reports(out: Path, groups: list[str]) -> dict[str, dict]:
    """The JSON of each group, after checking that the run wrote one JSON and one PNG per group and no more."""
    assert sorted(p.name for p in out.iterdir()) == sorted(f"gpu_{g}.{x}" for g in groups for x in ("json", "png"))
    docs = {g: json.loads((out / f"gpu_{g}.json").read_text()) for g in groups}
    for g, doc in docs.items():
        assert all(k in doc for k in REPORT_KEYS) and doc["device"] == "cpu"
        if g == "load":  # run through `mtpserve bench load`, a server subprocess, as typed
            assert doc["benchmark"] == "load" and doc["command"].startswith("mtpserve bench load --device cpu")
        else:
            assert doc["benchmark"] == f"gpu {g}" and doc["command"].startswith("python3 bench/gpu.py")
    return docs


def test_gpu_set_runs_on_cpu_and_writes_one_json_and_png_per_group(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    flags = [
        "--groups",
        "decode,trees,ttft",
        "--ks",
        "1",
        "--batches",
        "1,2",
        "--max-tokens",
        "6",
        "--variants",
        "none",
    ]
    flags += ["--tree-configs", "target-only,chain K=2", "--tree-batches", "1", "--ttft-lengths", "16,40"]
    run_gpu_set(model, out, *flags, "--ttft-ks", "0,1", "--ttft-busy", "2")
    docs = reports(out, ["decode", "trees", "ttft"])
    decode = docs["decode"]
    assert decode["errors"] == []
    assert [(r["k"], r["batch"]) for r in decode["results"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["outputs_equal_target_only"] == 1.0 for r in decode["results"])
    assert len(docs["trees"]["results"]) == 2
    ttft = docs["ttft"]["results"]
    assert [(r["k"], r["prompt_tokens"], r["busy"]) for r in ttft] == [
        (k, n, busy) for k in (0, 1) for n in (16, 40) for busy in (0, 2)
    ]


@pytest.mark.slow
def test_gpu_set_load_and_distributed_groups_on_cpu(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    flags = ["--groups", "distributed,load", "--distributed-batches", "1,2", "--distributed-ks", "0,1"]
    flags += ["--distributed-steps", "4", "--distributed-repeats", "1", "--load-streams", "16", "--load-rounds", "1"]
    run_gpu_set(model, out, *flags, "--load-lengths", "8,32")
    docs = reports(out, ["distributed", "load"])
    dist = docs["distributed"]
    assert dist["errors"] == [] and dist["model"]["shape"] == str(model)
    rows = dist["results"]
    assert [(r["setup"], r["k"], r["batch"]) for r in rows] == [
        (s, k, b) for k in (0, 1) for s in ("in-process", "ray-tp1") for b in (1, 2)
    ]
    for r in rows:
        assert r["step_ms"] > 0 and r["vs_in_process"] > 0
        assert bool(r["timeline_ms"]) == (r["setup"] == "ray-tp1")  # only the Ray path has hops to time
    (load,) = docs["load"]["results"]
    assert load["wrong"] == [] and load["after"]["kv_blocks_used"] == 0 and sum(load["ends"].values()) == 16


def test_grpc_stream_cost_probe_reports_both_servers(tmp_path: Path) -> None:
    """`bench/probes/grpc_stream_cost.py`: every stream's messages arrive from both servers, and the server CPU per
    message is measured (above zero) for each round."""
    probe = ROOT / "bench" / "probes" / "grpc_stream_cost.py"
    cmd = [sys.executable, str(probe), "--streams", "4", "--messages", "16", "--repeats", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((tmp_path / "grpc_stream_cost.json").read_text())
    assert set(doc["results"]) == {"sync", "aio"}
    for rows in doc["results"].values():
        assert len(rows) == 1 and rows[0]["messages"] == 4 * 16 and rows[0]["server_cpu_us_per_msg"] > 0


def test_gemv_tiles_probe_times_every_candidate_and_keeps_the_fastest(model: Path, tmp_path: Path) -> None:
    """`bench/probes/gemv_tiles.py` off CUDA (the fixed-buffer steps run eagerly, the tree's step is not
    captured and so not timed): every candidate's steps are timed at every depth, each padded row count whose
    depths ran gets the candidate fastest there, and both tables decode (the tree too) with target-only as
    the 1.0x base. The choice itself, on made-up timings: each row count reads only its own depths, a row
    count with an untimed depth is left out, and the tree's rows take only tiles with row groups."""
    probe = ROOT / "bench" / "probes" / "gemv_tiles.py"
    cmd = [sys.executable, str(probe), *dummy_flags(model), "--dtype", "float32", "--k", "3",
           "--candidates", "8x0,4x2r", "--repeats", "2", "--max-tokens", "6", "--tree-budget", "7",
           "--out", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((tmp_path / "gemv_tiles.json").read_text())
    assert set(doc["step_ms"]) == {"8x0", "4x2r"}
    times = {name: {int(d): ms for d, ms in by_depth.items()} for name, by_depth in doc["step_ms"].items()}
    assert all(set(t) == {0, 1, 2, 3} and min(t.values()) > 0 for t in times.values())
    want = {1: (0,), 2: (1,), 4: (2, 3)}
    fastest = {rows: min(times, key=lambda n: sum(times[n][d] for d in depths)) for rows, depths in want.items()}
    assert doc["tables"]["per_rows"] == ",".join(f"{rows}={name}" for rows, name in fastest.items())
    uniform = min(times, key=lambda n: sum(times[n].values()))
    assert doc["tables"]["uniform"] == f"1={uniform},2={uniform},4={uniform}"
    assert set(doc["tok_s"]) == {"per_rows", "default"}, "the uniform table runs only if the first loses tokens"
    assert doc["chosen_table"] == doc["tables"]["per_rows"]
    for table in doc["tok_s"].values():
        assert set(table) == {"target-only", "K=1", "K=2", "K=3", "tree7"} and table["target-only"]["speedup"] == 1.0
        assert all(r["tok_s"] > 0 for r in table.values()) and table["target-only"]["greedy_equal"]
        assert all(r["greedy_equal"] for r in table.values()), "fp32 on CPU: speculation is exact"
    a, b = parse_candidates("8x0,4x2r")
    cands = {"a": a, "b": b}
    made_up = {"a": {0: 1.0, 1: 2.0, 2: 3.0}, "b": {0: 2.0, 1: 1.0, 2: 1.0}}
    assert choose_tiles(made_up, cands) == {1: "a", 2: "b"}
    made_up["a"][3] = made_up["b"][3] = 1.0
    assert choose_tiles(made_up, cands) == {1: "a", 2: "b", 4: "b"}
    cands["c"] = parse_candidates("8x0g2")[0]  # a 15-node tree verifies 16 rows: tiles with groups only
    made_up["a"]["tree"], made_up["c"] = 0.5, {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0, "tree": 0.9}
    assert choose_tiles(made_up, cands, tree_budget=15) == {1: "a", 2: "b", 4: "b", 16: "c"}
    with pytest.raises(argparse.ArgumentTypeError, match="--candidates: tiles '8x'"):
        parse_candidates("4x2,8x")
