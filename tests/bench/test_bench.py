"""`mtpserve bench`: throughput JSON, prompt-field detection, the PR #18295 comparison, and the dev prompt sets."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtpserve.cluster.bench import acceptance as bench_acceptance
from mtpserve.cluster.bench import report as bench_report
from mtpserve.cluster.bench import throughput as bench_throughput
from mtpserve.cluster.cli.mtpserve import main
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.speculative.train.openers import OPENERS
from mtpserve.speculative.train.seed_prompts import SEED_PROMPTS
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.tiny import engine_config, mimic_head, mimic_target, random_prompts

ROOT = Path(__file__).resolve().parents[2]
PROMPT_FILES = {name: ROOT / "bench" / "prompts" / f"{name}.jsonl" for name in ("long_dev", "chat_dev")}
HELDOUT_FILES = {name: ROOT / "bench" / "prompts" / "heldout" / f"{name}.jsonl" for name in ("chat", "code", "math")}
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These tests time nothing; one thread avoids OpenMP stalls on a busy 2-core host (28 s vs 0.6 s here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- throughput ------------------------------------------------------------------------------------
def test_throughput_cli_on_dummy_model_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "res" / "t.json"
    argv = ["bench", "throughput", "--load-format", "dummy", "--model", str(model), "--device", "cpu"]
    argv += ["--no-speculation", "--batch-sizes", "1,3", "--prompt-len", "9", "--output-len", "5"]
    argv += ["--warmup-steps", "2", "--json", str(out), "--max-num-requests", "2"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/mtpserve", *argv])
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    for key in ("command", "date", "torch", "device", "dtype", "model", "speculation", "scheduler", "results"):
        assert key in doc, key
    assert doc["command"].startswith("mtpserve bench throughput --load-format dummy")
    assert doc["device"] == "cpu"
    assert doc["model"]["shape"]["hidden_size"] == 32
    assert doc["model"]["shape"]["num_hidden_layers"] == 2
    assert doc["speculation"]["enabled"] is False
    # --max-num-requests was given explicitly, so the batch of 3 is not given more slots
    assert doc["scheduler"]["max_num_requests"] == 2
    assert [r["batch_size"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert r["output_tokens"] == r["batch_size"] * 5
        assert r["decode_steps"] > 0
        for k in ("decode_tok_s", "decode_step_ms", "prefill_s", "ttft_mean_s", "ttft_max_s", "output_tok_s"):
            assert r[k] > 0, k
        assert r["ttft_max_s"] >= r["ttft_mean_s"]
        assert r["acceptance_length"] is None


def test_throughput_sizes_slots_and_cache_for_the_largest_batch() -> None:
    cfg = MTPServeConfig.from_dict({"scheduler": {"max_num_requests": 4, "block_size": 16}})
    sized = bench_throughput.throughput_config(cfg, [1, 8, 128], prompt_len=512, output_len=512)
    assert sized.scheduler.max_num_requests == 128
    k = sized.speculative.num_draft_tokens
    assert sized.scheduler.num_kv_blocks is not None
    assert sized.scheduler.num_kv_blocks * 16 >= 128 * (1024 + k)
    untouched = bench_throughput.throughput_config(cfg, [1, 8, 128], 512, 512, size_slots=False, size_cache=False)
    assert untouched == cfg


def test_throughput_speculative_on_mimic_reports_acceptance() -> None:
    args, w = mimic_target()
    cfg = engine_config(speculative={"num_draft_tokens": 2})
    engine = LLMEngine.from_weights(cfg, args, w, head=mimic_head(args, w))
    rows = bench_throughput.run_throughput(engine, [1, 4], prompt_len=12, output_len=10, warmup_steps=1)
    for r in rows:
        assert r.output_tokens == r.batch_size * 10
        assert r.preemptions == 0
        assert r.acceptance_length is not None and r.acceptance_length > 1.0
    table = bench_throughput.format_throughput_table(rows)
    assert "acc len" in table and len(table.splitlines()) == 4


# ---- acceptance: prompt files ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "P", "text": "not this"},
        {"turns": ["P", "second turn"], "question": "not this"},
        {"turns": [{"role": "user", "content": "P"}]},
        {"question": "P", "answer": "42"},
        {"text": "P", "id": 3},
    ],
)
def test_prompt_field_is_detected(tmp_path: Path, record: dict) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(record) + "\n\n" + json.dumps({**record}) + "\n")
    assert bench_acceptance.load_prompts(f) == ["P", "P"]
    assert bench_acceptance.load_prompts(f, num_prompts=1) == ["P"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"answer": "x"}\n', "no prompt field"),
        ('{"turns": []}\n', "no prompt field"),
        ('{"prompt": "ok"}\n{not json\n', ":2: not valid JSON"),
        ('["prompt"]\n', "expected a JSON object"),
        ("\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_are_refused(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(bench_report.BenchError, match=re.escape(message)):
        bench_acceptance.load_prompts(f)


def test_acceptance_cli_refuses_dummy_weights_and_no_speculation(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n')
    base = ["bench", "acceptance", "--prompts", str(f), "--model", str(model), "--load-format", "dummy"]
    assert main(base) == 2
    assert main([*base, "--no-speculation"]) == 2


# ---- acceptance: the PR #18295 comparison ----------------------------------------------------------
def mimic_factory() -> bench_report.EngineFactory:
    """Engines on the tiny mimic target, each with a fresh mimic head (high but imperfect acceptance)."""
    args, w = mimic_target()
    return lambda cfg: LLMEngine.from_weights(cfg, args, w, head=mimic_head(args, w))


def test_compare_shows_the_bug_and_the_fix_on_mimic() -> None:
    args, _ = mimic_target()
    prompts = random_prompts(4, args.vocab_size, [40, 23, 31, 37], seed=3)
    cfg = engine_config(speculative={"num_draft_tokens": 2, "draft": "random"})
    results = bench_acceptance.run_acceptance_settings(
        mimic_factory(), cfg, bench_acceptance.compare_settings(4), prompts, max_tokens=16, progress=False
    )
    sampled, prompt, whole = results
    assert [r.setting.name for r in results] == ["sampled", "prompt", "unchunked"]
    assert (sampled.chunk_size, prompt.chunk_size, whole.chunk_size) == (4, 4, 40)
    assert all(r.max_num_batched_tokens >= r.chunk_size for r in results), "the budget must not split chunks"
    assert [r.num_prompts for r in results] == [4, 4, 4]
    # greedy: the outputs are the same whatever the draft does
    assert sampled.output_tokens == prompt.output_tokens == whole.output_tokens == [16] * 4
    # the fix: chunked prefill with the prompt lookahead gives exactly the unchunked counters
    assert prompt.stats == whole.stats
    assert prompt.stats.drafted > 0
    # the bug: the sampled token at non-final chunk ends corrupts draft KV and costs acceptance
    assert sampled.stats.acceptance_rate < prompt.stats.acceptance_rate
    table = bench_acceptance.format_acceptance_table(results)
    assert all(name in table for name in ("sampled", "prompt", "unchunked", "none (40)"))
    doc = bench_acceptance.acceptance_report(
        cfg, args, results, {"compare": True}, command="mtpserve bench acceptance --compare"
    )
    assert [r["setting"] for r in doc["results"]] == ["sampled", "prompt", "unchunked"]
    assert doc["results"][1]["accepted_per_position"] == doc["results"][2]["accepted_per_position"]
    json.dumps(doc)


def test_acceptance_needs_a_draft_head() -> None:
    args, w = mimic_target()
    cfg = engine_config()
    setting = bench_acceptance.AcceptanceSetting("run", "prompt", 8)
    with pytest.raises(bench_report.BenchError, match="no draft head"):
        bench_acceptance.run_acceptance(
            lambda c: LLMEngine.from_weights(c, args, w), cfg, setting, [[1, 2, 3]], 4, progress=False
        )


# ---- dev prompt sets -------------------------------------------------------------------------------
def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def shared_shingles(a: str, b: str, n: int = 8) -> set[tuple[str, ...]]:
    """Runs of n consecutive words that both texts contain."""
    wa, wb = _words(a), _words(b)
    sa = {tuple(wa[i : i + n]) for i in range(len(wa) - n + 1)}
    sb = {tuple(wb[i : i + n]) for i in range(len(wb) - n + 1)}
    return sa & sb


def overlaps(text: str, others: tuple[str, ...] | list[str]) -> bool:
    """True when `text` equals, contains, is contained in, or shares 8 consecutive words with another text."""
    norm = " ".join(_words(text))
    for other in others:
        o = " ".join(_words(other))
        if norm == o or (o and o in norm) or (norm and norm in o) or shared_shingles(text, other):
            return True
    return False


def test_overlap_check_catches_copies() -> None:
    seed = SEED_PROMPTS[0]
    assert overlaps(seed, SEED_PROMPTS)
    assert overlaps(f"Context: a long document.\n\n{seed.upper()}", SEED_PROMPTS)
    words = _words(SEED_PROMPTS[1])[:8]
    assert overlaps("Please: " + " ".join(words) + " and more", SEED_PROMPTS)
    assert not overlaps("Tell me about the migration of arctic terns.", SEED_PROMPTS)


@pytest.mark.parametrize("name", sorted(PROMPT_FILES))
def test_dev_prompts_never_overlap_the_training_seed_prompts(name: str) -> None:
    texts = bench_acceptance.load_prompts(PROMPT_FILES[name])
    assert len(texts) >= (10 if name == "long_dev" else 30)
    assert len(set(texts)) == len(texts), "duplicate prompts"
    bad = [t[:60] for t in texts if overlaps(t, SEED_PROMPTS)]
    assert not bad, f"{name} overlaps the trainer's seed prompts: {bad}"


def training_templates() -> list[str]:
    """The prompt beginnings and templates the draft-data recipes use, placeholders dropped."""
    from mtpserve.speculative.train import prompt_parts as pp

    forms = (*pp.CHAT_STARTS, *pp.TASK_FORMS, *pp.LONG_STARTS, *OPENERS)
    starts = [s for s in forms if len(s.split()) >= 4]  # shorter: plain English
    return starts + [re.sub(r"\{[a-z]+\}", " ", t) for t in (*pp.MATH_STARTS, *pp.MATH_COMPLETE)]


@pytest.mark.parametrize("name", sorted(HELDOUT_FILES))
def test_heldout_sets_share_no_prompt_or_template_with_training(name: str) -> None:
    records = bench_acceptance.load_prompt_records(HELDOUT_FILES[name])
    assert len(records) == (60 if name == "chat" else 50) and len({t for t, _ in records}) == len(records)
    assert all(chat == (name != "code") for _, chat in records), "code is raw completion, the rest chat"
    starts = [t for t in training_templates() if "{" not in t and len(t.split()) <= 12]
    for text, _ in records:
        assert not overlaps(text, SEED_PROMPTS), text[:60]
        assert not any(" ".join(_words(text)).startswith(" ".join(_words(s))) for s in starts), text[:60]
        assert not any(shared_shingles(text, t, 6) for t in training_templates()), text[:60]


def test_prompt_format_picks_the_chat_template_per_record(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "format": "raw"}\n{"prompt": "b"}\n{"prompt": "c", "format": "chat"}\n')
    assert bench_acceptance.load_prompt_records(f) == [("a", False), ("b", True), ("c", True)]
    f.write_text('{"prompt": "a", "format": "markdown"}\n')
    with pytest.raises(bench_report.BenchError, match=":1: format must be 'chat' or 'raw'"):
        bench_acceptance.load_prompt_records(f)


def test_acceptance_reports_each_prompt_group() -> None:
    """Per-file counters add up to the total, and the table names each file."""
    args, _ = mimic_target()
    prompts = random_prompts(5, args.vocab_size, [12, 20, 7, 15, 9], seed=4)
    cfg = engine_config(speculative={"num_draft_tokens": 2, "draft": "random"})
    groups = ["chat", "chat", "code", "code", "math"]
    setting = bench_acceptance.AcceptanceSetting("run", "prompt", 8)
    res = bench_acceptance.run_acceptance(mimic_factory(), cfg, setting, prompts, 12, progress=False, groups=groups)
    assert list(res.by_group) == ["chat", "code", "math"]
    assert sum(g.drafted for g in res.by_group.values()) == res.stats.drafted > 0
    assert sum(g.accepted for g in res.by_group.values()) == res.stats.accepted
    assert [p["group"] for p in res.per_prompt] == groups
    assert res.to_dict()["by_group"]["math"]["drafted"] == res.by_group["math"].drafted
    table = bench_acceptance.format_group_table([res])
    assert all(g in table for g in ("chat", "code", "math"))


@pytest.mark.slow
def test_long_dev_prompts_are_at_least_512_tokens_with_the_chat_template() -> None:
    from tests.helpers.smol import smollm2

    tok = smollm2()[3]
    texts = bench_acceptance.load_prompts(PROMPT_FILES["long_dev"])
    ids = bench_acceptance.encode_texts(tok, texts)
    assert min(len(x) for x in ids) >= 512
    # encode_texts mirrors LLMEngine.encode_prompt, with and without the chat template
    holder = SimpleNamespace(tokenizer=tok)
    for chat in (True, False):
        assert (
            bench_acceptance.encode_texts(tok, texts[:2], chat)
            == [
                LLMEngine.encode_prompt(holder, t, chat)  # type: ignore[arg-type]
                for t in texts[:2]
            ]
        )


# ---- prefix cache: multi-turn chats ----------------------------------------------------------------
def test_prefix_cache_cli_reuses_the_document_and_changes_no_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers.service import write_tiny_model

    model, head = write_tiny_model(tmp_path / "model")
    out = tmp_path / "prefix.json"
    argv = ["bench", "prefix-cache", "--model", str(model), "--draft", str(head), "--device", "cpu", "--quiet"]
    argv += ["--prefix-len", "120", "--conversations", "3", "--max-tokens", "6", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["mtpserve", *argv])
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "prefix_cache" and doc["command"].startswith("mtpserve bench prefix-cache")
    assert doc["equal"] == {"tokens": 1.0, "acceptance": 1.0, "replies": True}
    assert doc["shared_prefix_tokens"] > 120
    cached, uncached = doc["modes"]["cached"], doc["modes"]["uncached"]
    assert cached["prefix_caching"] and not uncached["prefix_caching"]
    assert uncached["sequential_hit_tokens"] == 0
    block = cached["engine"]["scheduler"]["block_size"]
    # conversations 2 and 3 reuse the document's full blocks; every second turn reuses its first turn
    assert cached["sequential_hit_tokens"] >= 2 * (doc["shared_prefix_tokens"] // block - 1) * block
    first_turns, second_turns = cached["sequential"]["turn1"], cached["sequential"]["turn2"]
    assert all(t2["prompt_tokens"] > t1["prompt_tokens"] for t1, t2 in zip(first_turns, second_turns, strict=True))
    assert all(r["drafted"] > 0 for r in first_turns)
    ratios = doc["uncached_over_cached_ttft_and_cached_over_uncached_tok_s"]
    assert set(ratios) >= {"turn1_rest_median", "turn2_median", "concurrent_turn2_tok_per_s"}


def test_prefix_cache_cli_refuses_what_it_cannot_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "dummy"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    base = ["bench", "prefix-cache", "--device", "cpu"]
    assert main([*base, "--model", str(model), "--load-format", "dummy"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main([*base, "--document", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_process_tree_figures_count_the_engine_process() -> None:
    """The served process's CPU and memory figures include its children (the engine process is one)."""
    import os
    import subprocess

    from mtpserve.cluster.bench.procs import process_tree, tree_cpu_s, tree_rss_mb
    from tests.helpers.service import wait_for

    code = "import time; x = b'x' * (64 << 20); s = sum(range(3_000_000)); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert wait_for(lambda: child.pid in process_tree(os.getpid()) and tree_rss_mb(child.pid) > 60, 30)
        assert tree_rss_mb(os.getpid()) >= tree_rss_mb(child.pid) + 10  # this process's own memory on top
        child_cpu, own_cpu = tree_cpu_s(child.pid), tree_cpu_s(os.getpid())
        assert child_cpu is not None and own_cpu is not None and own_cpu >= child_cpu > 0
    finally:
        child.kill()
        child.wait()
