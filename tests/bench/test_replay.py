"""Replayed acceptance (`speculative/replay.py`, `mtpserve bench replay`): every verify step accepts exactly
what the recording says, in the eager path and in the fixed-shape steps CUDA captures; a recording taken from
an engine equals its counters and replays to the same tokens; the sub-command reports it as replayed; bad
recordings are refused naming the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mtpserve.cluster.bench.replay import shapes
from mtpserve.cluster.bench.replay_record import (
    AcceptanceRecorder,
    RecordedSet,
    Recording,
    load_recording,
    record_engine,
)
from mtpserve.cluster.bench.report import BenchError
from mtpserve.cluster.cli.mtpserve import main
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.messages import SeqPlan
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.replay import ReplayAcceptance
from mtpserve.speculative.tree import forced_walk, greedy_walk
from mtpserve.speculative.verify import forced_chain, verify_greedy
from mtpserve.workers.fused_step import FusedSpecStep
from mtpserve.workers.tree_step import FusedTreeStep
from mtpserve.workers.uniform_step import UniformTargetStep
from tests.helpers.service import ROOT, child_env, write_dummy_model
from tests.helpers.tiny import engine_config, mimic_head, mimic_target, random_prompts, with_steps

CHAIN = {"num_draft_tokens": 3}
TREE = {"num_draft_tokens": 4, "tree_budget": 16, "tree_width": 4}
CHAIN_COUNTS = [[3, 0, 2, 1], [1, 1], [0, 3, 3, 2, 0]]
TREE_PATHS = [[[1, 5, 9, 13], [], [2, 3]], [[4], [1, 2, 3, 4], [6, 7]]]  # not branches of the trees drafted here


def engine(
    spec: dict[str, int], replay: ReplayAcceptance | None, path: str = "eager", trained: bool = False
) -> LLMEngine:
    """A tiny mimic target drafting `spec` with a random head (its own acceptance differs from the replayed one),
    or the mimic head when `trained`; `path` picks how generation steps run: eagerly, or through the fixed-shape
    step CUDA captures (the fused chain step, overlapped; the uniform verify step; the tree step, overlapped)."""
    args, w = mimic_target()
    cfg = engine_config(scheduler={"chunk_size": 512, "max_num_batched_tokens": 128}, speculative=spec)
    if trained:
        head = mimic_head(args, w)
    else:
        head = MTPEagleHead(args)
        head.init_random(seed=3, std=0.15)
    eng = LLMEngine.from_weights(cfg, args, w, head=head, replay=replay)
    r: Any = eng.target
    k = spec["num_draft_tokens"]
    if path == "fused":
        with_steps(
            eng,
            chain=FusedSpecStep(
                r.model,
                r.cache,
                eng.draft,
                k,
                max_batch=8,
                max_blocks=16,
                device="cpu",
                use_graphs=False,
                replay=replay,
            ),
        )
        eng._launcher = eng.target  # launched steps take their inputs from the previous step's results
    elif path == "uniform":
        with_steps(
            eng,
            target=UniformTargetStep(
                r.model, r.cache, k + 1, max_batch=8, max_blocks=16, device="cpu", use_graphs=False, replay=replay
            ),
        )
    elif path == "tree":
        with_steps(
            eng,
            tree=FusedTreeStep(
                r.model, r.cache, eng.draft, max_batch=8, max_blocks=16, device="cpu", use_graphs=False, replay=replay
            ),
        )
    return eng


def count_steps(step: Any) -> list[int]:
    """Wrap a fixed-shape step's runner so its runs are counted."""
    calls: list[int] = []
    run = step.steps.run
    step.steps.run = lambda bucket, mode: (calls.append(bucket), run(bucket, mode))[1]
    return calls


@pytest.mark.parametrize(
    ("spec", "streams", "path"),
    [
        (CHAIN, CHAIN_COUNTS, "eager"),
        (CHAIN, CHAIN_COUNTS, "fused"),
        (CHAIN, CHAIN_COUNTS, "uniform"),
        (TREE, TREE_PATHS, "eager"),
        (TREE, TREE_PATHS, "tree"),
    ],
)
def test_every_verify_step_accepts_what_the_recording_says(spec: dict[str, int], streams: list, path: str) -> None:
    """7 requests replay 2-3 recorded streams (request r replays stream r mod n, cycling through it): each verify
    step's accepted count is the recorded one, and the emitted tokens are the accepted drafts plus one."""
    replay = ReplayAcceptance.from_counts(streams) if spec is CHAIN else ReplayAcceptance(streams)
    eng = engine(spec, replay, path)
    r: Any = eng.target
    step = {"fused": r.steps.chain, "uniform": r.steps.target, "tree": r.steps.tree}.get(path)
    calls = count_steps(step) if step is not None else []
    recorder = AcceptanceRecorder(eng, paths=spec is CHAIN)
    prompts = random_prompts(7, eng.args.vocab_size, [21, 1, 40, 9, 13], seed=3)
    done = eng.generate(prompts, {"max_tokens": 30, "ignore_eos": True})
    counted = 0
    for i, c in enumerate(done):
        got = recorder.counts[c.request_id]
        stream = [len(p) if isinstance(p, list) else p for p in streams[i % len(streams)]]
        assert got == [stream[s % len(stream)] for s in range(len(got))], (i, got, stream)
        assert len(c.token_ids) == 30
        counted += len(got)
    assert counted == eng.totals.verify_steps
    assert eng.totals.accepted == sum(sum(recorder.counts[c.request_id]) for c in done)
    assert path == "eager" or len(calls) >= 10, "the fixed-shape step ran"
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks, "every KV block comes back"


@pytest.mark.parametrize("spec", [CHAIN, TREE])
def test_a_recording_matches_the_engines_counters_and_replays_to_the_same_tokens(
    spec: dict[str, int], tmp_path: Path
) -> None:
    """Recorded from a real (tiny, mimic head) engine run, the streams sum to its counters; written and read
    back they are unchanged; replayed on the same model they accept the same drafts step by step, so the
    greedy tokens are the same too."""
    prompts = random_prompts(5, 96, [21, 1, 40, 9, 13], seed=3)
    eng = engine(spec, None, trained=True)
    streams = record_engine(eng, prompts, 24)
    assert sum(len(s) for s in streams) == eng.totals.verify_steps
    assert sum(len(p) for s in streams for p in s) == eng.totals.accepted > 0
    if spec is TREE:
        assert any(p != list(range(1, len(p) + 1)) for s in streams for p in s), "some branch leaves node 1"
    name = "tree K=4 N=16 w=4" if spec is TREE else "chain K=3"
    out = tmp_path / "rec.json"
    Recording("tiny", "mimic", 24, {"set": RecordedSet("p.jsonl", [len(p) for p in prompts], {name: streams})}).save(
        out, shapes()
    )
    loaded = load_recording(out, shapes())
    assert loaded.sets["set"].streams[name] == streams
    reference = engine(spec, None, trained=True).generate(prompts, {"max_tokens": 24})
    replayed = engine(spec, ReplayAcceptance(streams), trained=True)
    again = record_engine(replayed, prompts, 24)
    assert again == streams
    assert [c.token_ids for c in replayed.generate(prompts, {"max_tokens": 24})] == [c.token_ids for c in reference]


def test_recording_through_tree_steps_launched_ahead_gives_the_eager_streams() -> None:
    """A tree step launched ahead carries placeholder drafts (its tree comes from the step before on the device);
    the recorder is told the tree each step verified, so recording through launched tree steps gives the eager
    engine's paths."""
    prompts = random_prompts(5, 96, [21, 1, 40, 9, 13], seed=3)
    want = record_engine(engine(TREE, None, trained=True), prompts, 24)
    eng = engine(TREE, None, "tree", trained=True)
    r: Any = eng.target
    queued: list[bool] = []
    launch = r.steps.tree.launch
    r.steps.tree.launch = lambda plan, bucket, u=None, after=None: (
        queued.append(after is not None) or launch(plan, bucket, u, after)
    )
    assert record_engine(eng, prompts, 24) == want
    assert sum(queued) >= 5, queued


def test_forced_verify_and_walk_agree_with_the_greedy_ones_on_their_own_results() -> None:
    """Forced with what the comparison would accept, the forced chain and walk return its outputs exactly;
    forced with more than a step drafted, they clamp."""
    g = torch.Generator().manual_seed(0)
    argmax = torch.randint(0, 5, (64, 4), generator=g)
    drafts = torch.where(torch.rand(64, 3, generator=g) < 0.7, argmax[:, :3], torch.randint(0, 5, (64, 3), generator=g))
    n_acc, tokens = verify_greedy(argmax, drafts)
    forced = torch.cat([n_acc[:, None], torch.zeros(64, 3, dtype=torch.long)], dim=1)
    got = forced_chain(argmax, drafts, forced)
    assert torch.equal(got[0], n_acc) and torch.equal(got[1], tokens)
    over = forced_chain(argmax, drafts, torch.full((64, 4), 9))
    assert over[0].tolist() == [3] * 64 and torch.equal(over[1][:, :3], drafts)

    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2]]).expand(64, -1)
    tokens = torch.randint(0, 3, (64, 7), generator=g)
    tree_argmax = torch.randint(0, 3, (64, 7), generator=g)
    n_acc, path, bonus = greedy_walk(tokens, parents, tree_argmax, 3)
    forced = torch.cat([n_acc[:, None], path, torch.zeros(64, 3, dtype=torch.long)], dim=1)
    got = forced_walk(forced, tree_argmax, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, (n_acc, path, bonus), strict=True))
    assert n_acc.max() > 0 and n_acc.min() == 0


def test_replay_refuses_sampling_requests() -> None:
    eng = engine(CHAIN, ReplayAcceptance.from_counts([[1]]))
    eng.add_request([1, 2, 3], {"max_tokens": 4, "temperature": 0.7, "seed": 1})
    with pytest.raises(ValueError, match="greedy requests only"):
        while eng.has_unfinished():
            eng.step()


def write_recording(path: Path, configs: dict[str, Any], lengths: list[int] | None = None) -> Path:
    doc = {
        "format": "mtpserve-acceptance-recording/1",
        "model": "SmolLM2 (test)",
        "draft": "head (test)",
        "max_tokens": 8,
        "sets": {"chat": {"source": "chat.jsonl", "prompt_tokens": lengths or [12, 30], "configs": configs}},
    }
    path.write_text(json.dumps(doc))
    return path


def test_bench_replay_reports_replayed_acceptance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_dummy_model(tmp_path / "model")
    rec = write_recording(
        tmp_path / "rec.json",
        {
            "chain K=2": {"accepted": [[2, 0, 1], [1, 2]]},
            "tree K=3 N=8 w=3": {"paths": [[[1, 4], [], [2, 5, 8]], [[3]]]},
        },
    )
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    argv = ["bench", "replay", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--acceptance", str(rec), "--configs", "target-only,chain K=2,tree K=3 N=8 w=3", "--batches", "1,3"]
    argv += ["--max-tokens", "8", "--num-requests", "2", "--threads", "1", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    line = f"acceptance replayed from {rec} (recorded on SmolLM2 (test) + head (test)), not measured on this model"
    assert line in printed
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "replay" and doc["replayed"] is True and doc["banner"] == line
    assert doc["acceptance_source"]["sets"]["chat"]["acceptance_length"] == {"chain K=2": 2.2, "tree K=3 N=8 w=3": 2.5}
    rows = doc["results"]
    assert [(r["config"], r["batch"], r["requests"]) for r in rows] == [
        (c, b, n) for c in ("target-only", "chain K=2", "tree K=3 N=8 w=3") for b, n in ((1, 2), (3, 3))
    ]
    for r in rows:
        assert r["tok_s"] > 0 and r["step_ms"] > 0 and r["speedup"] is not None and r["full_speedup"] is not None
        if r["config"] == "target-only":  # every request runs to max_tokens together: no tail
            assert r["speedup"] == 1.0 and r["acceptance_length"] is None and r["full_steps"] == r["steps"]
            continue
        if r["batch"] == 3:  # the three requests accept differently: the last steps run without the first done
            assert 0 < r["full_steps"] < r["steps"]
        assert r["steps_as_recorded"] == 1.0
        assert r["acceptance_length"] == r["acceptance_length_replayed"]
        assert r["acceptance_length"] > 1.5  # random weights alone accept nothing
        assert r["acceptance_length_recorded"] in (2.2, 2.5)
    assert png.stat().st_size > 0


def test_bench_replay_records_then_replays(tmp_path: Path) -> None:
    """--record writes the recording from a model's greedy run (here random weights and head, no tokenizer)
    and the replay reads it back; recording another configuration into the file adds it."""
    model = write_dummy_model(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "def f(x):", "format": "raw"}\n')
    rec, out = tmp_path / "rec.json", tmp_path / "replay.json"
    argv = ["bench", "replay", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--acceptance", str(rec), "--record", "--record-model", str(model), "--record-load-format", "dummy"]
    argv += ["--record-draft", "random", "--record-device", "cpu", "--prompts", str(prompts)]
    argv += ["--configs", "chain K=1", "--batches", "2", "--max-tokens", "5", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    recording = load_recording(rec, shapes())
    assert recording.max_tokens == 5 and list(recording.sets) == ["p"]
    assert recording.sets["p"].prompt_tokens == [11, 9]  # UTF-8 bytes without a tokenizer
    assert json.loads(out.read_text())["results"][0]["steps_as_recorded"] == 1.0
    argv[argv.index("--configs") + 1] = "adaptive K=3"  # a second recording into the same file keeps the first
    assert main(argv) == 0
    both = load_recording(rec, shapes()).sets["p"]
    assert set(both.streams) == {"chain K=1", "adaptive K=3"} and both.positional == {"adaptive K=3"}


@pytest.mark.parametrize(
    ("configs", "text", "message"),
    [
        (None, None, "--acceptance: recording .* does not exist"),
        ({}, "{not json", "not valid JSON"),
        ({"chain K=3": {"accepted": [[1], [2]]}}, None, r"sets\.chat\.configs: no recording of 'chain K=2'"),
        ({"chain K=2": {"accepted": [[1, 3], [2]]}}, None, r'configs\["chain K=2"\]\.accepted\[0\]\[1\]: 3 is not'),
        ({"chain K=2": {"accepted": [[1]]}}, None, r"accepted: holds 1 requests, prompt_tokens 2"),
        ({"chain K=9": {"accepted": [[1], [1]]}}, None, r'configs\["chain K=9"\]: not a speculative configuration'),
        ({"chain K=2": {"paths": [[1], [1]]}}, None, r"expected an object with 'accepted'"),
    ],
)
def test_bad_recordings_are_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], configs: Any, text: str | None, message: str
) -> None:
    model = write_dummy_model(tmp_path / "model")
    rec = tmp_path / "rec.json"
    if configs is not None:
        write_recording(rec, configs)
    if text is not None:
        rec.write_text(text)
    argv = ["bench", "replay", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    assert main([*argv, "--acceptance", str(rec), "--configs", "target-only,chain K=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpserve: ")
    assert re.search(message, err), err


def test_a_tree_path_must_be_increasing_nodes_within_the_budget(tmp_path: Path) -> None:
    for bad in ([3, 2], [1, 17], [1, 2, 3, 4, 5]):
        rec = write_recording(tmp_path / "rec.json", {"tree K=4 N=16 w=4": {"paths": [[bad], [[1]]]}})
        with pytest.raises(BenchError, match=r'configs\["tree K=4 N=16 w=4"\]\.paths\[0\]\[0\]: .* is not a path'):
            load_recording(rec, shapes())


def test_gpu_set_replay_group_dry_run_on_cpu(tmp_path: Path) -> None:
    """bench/gpu.py's replay group records on --model and replays at --replay-shape in one process (tiny random
    models on CPU here; the real SmolLM2 and Llama-3-8B's shape on the GPU)."""
    model = write_dummy_model(tmp_path / "model")
    out = tmp_path / "gpu"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--model", str(model), "--load-format", "dummy"]
    cmd += ["--draft", "random", "--device", "cpu", "--out", str(out), "--groups", "replay", "--max-tokens", "5"]
    cmd += ["--replay-shape", str(model), "--replay-configs", "target-only,tree K=3 N=8 w=3", "--replay-batches", "2"]
    cmd += ["--replay-requests", "2", "--replay-num-prompts", "2"]
    res = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_replay.json", "gpu_replay.png", "gpu_replay_recording.json"]
    doc = json.loads((out / "gpu_replay.json").read_text())
    assert doc["benchmark"] == "gpu replay" and doc["replayed"] is True and "acceptance replayed from" in res.stdout
    assert [(r["set"], r["config"]) for r in doc["results"]] == [
        (s, c) for c in ("target-only", "tree K=3 N=8 w=3") for s in ("chat", "code", "math")
    ]
    recording = load_recording(out / "gpu_replay_recording.json", shapes())
    assert [len(s.prompt_tokens) for s in recording.sets.values()] == [2, 2, 2]


def test_positional_replay_moves_each_request_by_what_its_steps_accept() -> None:
    """Per-position runs: a step of depth d at offset o accepts min(run[o], d) and moves the request past the
    accepted drafts and the bonus; a depth-0 step moves it by one; a step deeper than the request's last one
    accepts at most that one's depth (the rest of its drafts are padding)."""
    runs = [[list(range(1, n + 1)) for n in (3, 1, 0, 2, 3, 3, 0, 1)]]
    replay = ReplayAcceptance(runs, positional=True)
    seq = [SeqPlan("a", [0], 0, [], is_context=False, is_final_chunk=False, lookahead_token=-1)]
    counts = [int(replay.take(seq, width)[0, 0]) for width in (4, 2, 1, 4, 4, 2)]
    # offsets: 0 (run 3, depth 3) -> 4 (run 3, depth 1) -> 6 (depth 0) -> 7 (run 1; depth 3 after depth 0: none)
    # -> 8 = 0 (run 3, depth 3) -> 4 (run 3, depth 1)
    assert counts == [3, 1, 0, 0, 3, 1]
    assert replay.handed["a"] == [3, 1, 3, 1]  # steps without real drafts verify nothing and are not counted


def test_position_runs_match_the_steps_a_fixed_chain_takes(tmp_path: Path) -> None:
    """Teacher-forced per-position runs from the mimic engine, walked as a K=3 chain walks them (start at 0,
    then past each step's accepted drafts and bonus), equal the accepted counts the engine's own K=3 run
    records, request by request; written and read back they are unchanged."""
    from mtpserve.cluster.bench.replay_record import position_runs, walked

    prompts = random_prompts(5, 96, [21, 1, 40, 9, 13], seed=3)
    want = record_engine(engine(CHAIN, None, trained=True), prompts, 24)
    runs = position_runs(engine({**CHAIN, "adaptive": True}, None, trained=True), prompts, 24, 3)
    for stream, run in zip(want, runs, strict=True):
        along = [len(run[o]) for o in walked(run)]
        assert along[: len(stream) - 1] == [len(p) for p in stream][:-1]  # the last chain may pass the answer
    assert sum(len(p) for r in runs for p in r) > 0
    out = tmp_path / "rec.json"
    rec = RecordedSet("p.jsonl", [len(p) for p in prompts], {"adaptive K=3": runs}, {"adaptive K=3"})
    Recording("tiny", "mimic", 24, {"set": rec}).save(out, shapes())
    loaded = load_recording(out, shapes()).sets["set"]
    assert loaded.streams["adaptive K=3"] == runs and loaded.positional == {"adaptive K=3"}
    assert loaded.acceptance_length("adaptive K=3") > 1.5


@pytest.mark.parametrize("path", ["eager", "fused"])
def test_adaptive_steps_replay_the_recorded_runs(path: str) -> None:
    """An adaptive engine forced to switch depths with the batch replays per-position runs: every verify step
    accepts what the replay hands it (so measured and replayed acceptance agree), at more than one depth."""
    from tests.speculative.test_adaptive import PARAMS, forced_policy, run

    runs = [[list(range(1, n + 1)) for n in (3, 2, 0, 1, 3, 3, 2, 0, 1, 2, 3, 0)]] * 2
    replay = ReplayAcceptance(runs, positional=True)
    eng = engine({**CHAIN, "adaptive": True}, replay)
    if path == "fused":
        r: Any = eng.target
        from mtpserve.workers.fused_step import FusedDepthSteps

        r = with_steps(eng, chain=FusedDepthSteps(
            {
                d: FusedSpecStep(
                    r.model, r.cache, eng.draft, d, max_batch=8, max_blocks=16, device="cpu", use_graphs=False,
                    replay=replay,
                )
                for d in range(4)
            }
        ))  # fmt: skip
    eng.scheduler.depth = policy = forced_policy({1: 3, 2: 1, 4: 0, 8: 2})
    recorder = AcceptanceRecorder(eng, paths=False)
    prompts = random_prompts(4, 96, [17, 5, 11, 23], seed=4)
    run(eng, prompts, PARAMS)  # requests of different lengths: the batch shrinks, the depth changes
    assert sum(1 for d, n in enumerate(policy.steps_per_depth) if d and n) >= 2, policy.steps_per_depth
    for rid, got in recorder.counts.items():
        assert got == replay.handed[rid][: len(got)]
    assert sum(sum(c) for c in recorder.counts.values()) > 0


def test_bench_replay_replays_the_adaptive_default(tmp_path: Path) -> None:
    """`bench replay --configs adaptive K=3` reads per-position runs and replays them through the adaptive
    engine: every counted verify step accepts what the replay handed it."""
    model = write_dummy_model(tmp_path / "model")
    runs = [[3, 1, 0, 2, 3, 3, 0, 1, 2, 0, 3, 1], [2, 2, 0, 3, 1, 0, 0, 3]]
    rec = write_recording(tmp_path / "rec.json", {"adaptive K=3": {"runs": runs}})
    out = tmp_path / "replay.json"
    argv = ["bench", "replay", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    argv += ["--acceptance", str(rec), "--configs", "target-only,adaptive K=3", "--batches", "1,2"]
    argv += ["--max-tokens", "12", "--num-requests", "2", "--threads", "1", "--json", str(out), "--draft", "random"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    rows = [r for r in doc["results"] if r["config"] == "adaptive K=3"]
    assert len(rows) == 2
    for r in rows:
        assert r["steps_as_recorded"] == 1.0
        assert r["acceptance_length"] == r["acceptance_length_replayed"]
    # along a K=3 chain: offsets 0 (3), 4 (3), 8 (2), 11 (1) -> 9 / 4; 0 (2), 3 (3), 7 (3) -> 8 / 3; pooled 17 / 7
    assert doc["acceptance_source"]["sets"]["chat"]["acceptance_length"]["adaptive K=3"] == round(1 + 17 / 7, 4)
