"""`mtpserve train-draft` on CPU with a tiny random Llama target (no tokenizer: token-level prompts).

The target's weights are scaled so its greedy continuations are neither constant nor noise: embedding and
lm_head std 0.5 against layer std 0.1 make the next token depend on both the current token and the
context (the best token-bigram rule explains about half of the target's choices; responses use ~29 of
40 tokens distinct; next-token entropy ~1.8 nats). A dense target with uniform std is either near-uniform
(small std) or context-chaotic (large std), and a head trained for seconds cannot learn the latter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtpserve.cluster.cli.cmd_train import DEFAULTS, _mix
from mtpserve.cluster.cli.mtpserve import main
from mtpserve.cluster.cli.train_generator import EngineGenerator
from mtpserve.modeling.attention import AttentionMetadata
from mtpserve.modeling.model import LlamaArgs, LlamaModel, random_llama_weights
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.train.batches import HiddenStore
from mtpserve.speculative.train.data import DataConfig, load_dataset
from mtpserve.speculative.train.dense import head_unrolled, target_hidden, unroll_mask
from mtpserve.speculative.train.eval import evaluate
from mtpserve.speculative.train.generators import GenSettings, HFGenerator
from mtpserve.speculative.train.pipeline import TrainDraftOptions
from mtpserve.speculative.train.recipes import RecipeSettings
from mtpserve.speculative.train.schedule import next_replan
from mtpserve.speculative.train.trainer import TrainConfig, build_shared

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
ARGS = LlamaArgs.from_hf_dict(CONFIG)
DEV_FRACTION = "0.1"


def tiny_weights() -> dict[str, torch.Tensor]:
    """Layer weights std 0.1; embedding and lm_head std 0.5 (see the module docstring)."""
    w = random_llama_weights(ARGS, seed=0, std=0.1)
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 5.0
    w["lm_head.weight"] = w["lm_head.weight"] * 5.0
    return w


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The CI box is small and shared; one intra-op thread is faster there than two contended ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF Llama directory: config.json + model.safetensors, no tokenizer."""
    d = tmp_path_factory.mktemp("tiny-target")
    (d / "config.json").write_text(json.dumps(CONFIG))
    save_file({k: v.contiguous() for k, v in tiny_weights().items()}, str(d / "model.safetensors"))
    return d


def cli(*argv: object) -> int:
    """Run `mtpserve` in process."""
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def data_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset, built by our engine: 4 parts of 32 random-token prompts, 32-token answers."""
    d = tmp_path_factory.mktemp("data")
    rc = cli(
        "train-draft", "--stage", "data", "--target", target_dir, "--device", "cpu", "--data-dir", d,
        "--mix", "random=4", "--part-size", 32, "--max-new-tokens", 32, "--gen-batch-size", 32,
    )  # fmt: skip
    assert rc == 0
    return d


def train_args(target_dir: Path, data_dir: Path, out: Path, *extra: object) -> list[object]:
    """Common flags of the training runs below."""
    return [
        "train-draft", "--stage", "train", "--target", target_dir, "--device", "cpu", "--data-dir", data_dir,
        "--out", out, "--batch-size", 16, "--lr", "3e-3", "-k", 3, "--no-init-from-target",
        "--dev-fraction", DEV_FRACTION, *extra,
    ]  # fmt: skip


def test_dataset_meta_records_settings_and_counts(data_dir: Path) -> None:
    """The dataset stores ids + response starts only, and meta.json says what was built and how."""
    meta = json.loads((data_dir / "meta.json").read_text())
    ds = load_dataset(data_dir)
    assert meta["counts"]["sequences"] == len(ds) == meta["counts"]["by_source"]["random"] >= 120
    assert "recomputes" in meta["hidden_states"] and meta["generator"] == "engine"
    assert meta["settings"]["settings"]["max_new_tokens"] == 32 and meta["settings"]["mix"] == {"random": 4}
    assert meta["shards"] == [f"parts/random-{i:04d}.pt" for i in range(4)]
    for ids, r in zip(ds.ids, ds.response_start, strict=True):
        assert 0 < r < ids.numel() - 1


def test_split_holds_dev_prompts_apart(data_dir: Path) -> None:
    """Dev is greedy-only and disjoint from train; a held-out source goes wholly to dev (sampled ones dropped)."""
    ds = load_dataset(data_dir)
    train, dev = ds.split(0.1, 0)
    assert dev and not set(train) & set(dev) and len(train) + len(dev) == len(ds)
    assert all(ds.greedy[i] for i in dev)
    ds.source[:10] = ["other"] * 10
    train, dev = ds.split(0.1, 0, ("other",))
    held = set(range(10))
    assert not held & set(train)
    assert {i for i in held if ds.greedy[i]} <= set(dev)
    assert any(ds.source[i] == "random" for i in dev)


def test_training_raises_acceptance_well_above_untrained(target_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """150 steps lift the K=3 dev acceptance length by >= 0.3 over the untrained (random) head.

    In development the same run reached about 1.55 from 1.00 within 100 steps; CPU fp32 with fixed seeds
    is deterministic, so the 0.3 margin leaves room for platform rounding differences, not for luck.
    """
    out = tmp_path / "head.safetensors"
    assert cli(*train_args(target_dir, data_dir, out, "--steps", 150, "--eval-every", 50, "--ckpt-every", 0)) == 0
    res = json.loads(out.with_name("head.results.json").read_text())
    before, after = res["dev_initial"], res["dev"]
    assert before["acceptance_length"] < 1.1
    assert after["acceptance_length"] >= before["acceptance_length"] + 0.3
    assert after["per_position"][0] >= max(0.2, 2 * before["per_position"][0] + 0.05)
    assert len(after["per_position"]) == 3 and after["bases"] > 100
    assert res["train"]["steps"] == 150 and [h["step"] for h in res["history"]] == [0, 50, 100, 150]

    # The exported head, scored independently, gives the recorded figure.
    shared = build_shared(ARGS, tiny_weights(), "cpu", torch.float32)
    ds = load_dataset(data_dir)
    _, dev = ds.split(float(DEV_FRACTION), 0)
    head = MTPEagleHead.load(out, ARGS)
    again = evaluate(head, shared, HiddenStore(shared, ds, torch.device("cpu")), dev, 3)
    assert again["acceptance_length"] == pytest.approx(after["acceptance_length"], abs=1e-9)
    untrained = MTPEagleHead(ARGS)
    untrained.init_random(seed=123)
    base = evaluate(untrained, shared, HiddenStore(shared, ds, torch.device("cpu")), dev, 3)
    assert again["acceptance_length"] >= base["acceptance_length"] + 0.3

    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "--num-draft-tokens 3" in card and "--steps 150" in card
    trained_row = next(line for line in card.splitlines() if line.startswith("| trained |"))
    want = [after[f"{key}acceptance_length"] for key in ("first_", "online_", "")]
    assert trained_row.startswith("| trained | " + " | ".join(f"{v:.3f}" for v in want) + " |")
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["steps"] == "150" and float(meta["dev_acceptance_length"]) == pytest.approx(
        after["acceptance_length"], abs=1e-4
    )
    assert float(meta["dev_decoding_path_acceptance_length"]) == pytest.approx(
        after["online_acceptance_length"], abs=1e-4
    )
    assert float(meta["dev_first_tokens_acceptance_length"]) == pytest.approx(
        after["first_acceptance_length"], abs=1e-4
    )


def test_checkpoint_reloads_identically_and_resume_continues(target_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """Pause at 20 of 40 steps, resume to 40: same weights as an uninterrupted run, and the exported head
    reloads to draft outputs identical to the checkpoint's."""
    common = ["--steps", 40, "--eval-every", 20, "--ckpt-every", 20]
    straight = tmp_path / "straight" / "head.safetensors"
    assert cli(*train_args(target_dir, data_dir, straight, *common, "--ckpt-dir", tmp_path / "ck-a")) == 0
    paused = tmp_path / "paused" / "head.safetensors"
    ckpt = tmp_path / "ck-b"
    assert cli(*train_args(target_dir, data_dir, paused, *common, "--ckpt-dir", ckpt, "--pause-after", 20)) == 0
    first = json.loads(paused.with_name("head.results.json").read_text())
    assert first["train"]["steps"] == 20 and first["train"]["stopped_by"].startswith("paused")
    resumed = tmp_path / "resumed" / "head.safetensors"
    assert cli(*train_args(target_dir, data_dir, resumed, *common, "--ckpt-dir", ckpt, "--resume")) == 0
    res = json.loads(resumed.with_name("head.results.json").read_text())
    assert res["train"]["resumed_from"] == 20 and res["train"]["steps"] == 40
    assert [h["step"] for h in res["history"]][:2] == [0, 20]

    a, b = MTPEagleHead.load(straight, ARGS), MTPEagleHead.load(resumed, ARGS)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-5), name

    state = torch.load(ckpt / "latest.pt", weights_only=False)
    assert state["step"] == 40
    from_ckpt = MTPEagleHead(ARGS)
    from_ckpt.load_state_dict(state["heads"]["head"]["head"])
    shared = build_shared(ARGS, tiny_weights(), "cpu", torch.float32)
    ds = load_dataset(data_dir)
    batch = HiddenStore(shared, ds, torch.device("cpu")).batch(list(range(8)))
    with torch.no_grad():
        outs_file = head_unrolled(b.eval(), shared, batch.ids, batch.hidden, steps=3)
        outs_ckpt = head_unrolled(from_ckpt.eval(), shared, batch.ids, batch.hidden, steps=3)
    for x, y in zip(outs_file, outs_ckpt, strict=True):
        assert torch.equal(x, y)
        assert torch.equal(shared.logits(x).argmax(-1), shared.logits(y).argmax(-1))


def test_init_head_continues_a_trained_head_and_a_wider_mlp_starts_equal(
    target_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Heads started from a trained file (one as wide, one with twice the MLP, one with a second decoder
    layer) score exactly what it scores before their first step, then all move; the files keep their shape."""
    src = tmp_path / "src" / "head.safetensors"
    assert cli(*train_args(target_dir, data_dir, src, "--steps", 40, "--eval-every", 0, "--ckpt-every", 0)) == 0
    scored = json.loads(src.with_name("head.results.json").read_text())["dev"]["acceptance_length"]
    out = tmp_path / "cont" / "head.safetensors"
    wide = 2 * ARGS.intermediate_size
    specs = ["--head-spec", "same:layers=last", "--head-spec", f"wide:layers=last,mlp={wide}"]
    specs += ["--head-spec", "deep:layers=last,decoder=2"]
    extra = ["--steps", 10, "--eval-every", 0, "--ckpt-every", 0, "--init-head", src, *specs]
    assert cli(*train_args(target_dir, data_dir, out, *extra)) == 0
    res = json.loads(out.with_name("head.results.json").read_text())
    assert "head.safetensors" in res["train"]["init"]
    for name in ("same", "wide", "deep"):
        assert res["heads"][name]["dev_initial"]["acceptance_length"] == pytest.approx(scored, abs=1e-9)
    before = MTPEagleHead.load(src, ARGS)
    same = MTPEagleHead.load(out.with_name("head-same.safetensors"), ARGS)
    grown = MTPEagleHead.load(out.with_name("head-wide.safetensors"), ARGS)
    assert same.mlp_size == ARGS.intermediate_size and grown.mlp_size == wide
    down = grown.layer.mlp.down_proj.weight
    assert down.shape[1] == wide and down[:, ARGS.intermediate_size :].abs().sum() > 0, "the extra units learn"
    assert not torch.equal(same.eh_proj.weight, before.eh_proj.weight)
    deep = MTPEagleHead.load(out.with_name("head-deep.safetensors"), ARGS)
    assert deep.num_layers == 2 and deep.extra_layers[0].mlp.down_proj.weight.abs().sum() > 0, "the layer learns"


def test_init_head_refuses_a_missing_file_or_another_layout(
    target_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "h.safetensors"
    assert cli(*train_args(target_dir, data_dir, out, "--steps", 1, "--init-head", tmp_path / "none")) == 2
    assert "--init-head" in capsys.readouterr().err
    other = MTPEagleHead(ARGS, (0, 1))
    other.save(tmp_path / "fused.safetensors")
    rc = cli(*train_args(target_dir, data_dir, out, "--steps", 1, "--init-head", tmp_path / "fused.safetensors"))
    assert rc == 2
    err = capsys.readouterr().err
    assert "--init-head" in err and "feature layers [0, 1]" in err


def test_time_budget_cuts_the_schedule_to_fit(target_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    """With --time-budget the run stops in time, sized its cosine schedule to the steps it ran, and exports."""
    out = tmp_path / "head.safetensors"
    budget = 14.0
    t0 = time.monotonic()
    extra = ["--steps", 100000, "--eval-every", 0, "--ckpt-every", 0, "--time-budget", budget]
    assert cli(*train_args(target_dir, data_dir, out, *extra)) == 0
    assert time.monotonic() - t0 <= budget + 4.0
    train = json.loads(out.with_name("head.results.json").read_text())["train"]
    assert train["stopped_by"] == "time budget" and 50 < train["steps"] < 100000
    # The cosine schedule was sized from measured step times; on a busy CPU the last steps may run slower.
    assert 0.6 * train["schedule_steps"] <= train["steps"] <= train["schedule_steps"]
    # The default warmup is 5% of the schedule planned while it runs and is kept once passed, so a later,
    # shorter plan (slow steps near the end) can leave it just above 5% of the final one; never near 5% of
    # the 100,000 steps requested.
    assert train["warmup_steps"] <= max(24, int(train["steps"] / 0.6) // 20)


def test_resumed_runs_replan_from_their_own_start() -> None:
    """A run resumed at step 3555 re-sizes its schedule 92 and 368 steps in, as a fresh run does from 0;
    planning only at 4x the absolute step would have left it on its cold first estimate."""
    assert next_replan(23, 0) == 92 and next_replan(92, 0) == 368
    assert next_replan(3555 + 23, 3555) == 3555 + 92
    assert next_replan(3555 + 92, 3555) == 3555 + 368


def test_bad_arguments_give_clear_errors(target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Missing target, empty dataset, an empty mix, text recipes without a tokenizer, and K < 1 each exit 2
    naming the flag."""
    missing = tmp_path / "nope"
    assert cli("train-draft", "--target", missing, "--device", "cpu", "--data-dir", tmp_path / "d") == 2
    err = capsys.readouterr().err
    assert "--target" in err and "does not exist" in err and str(missing) in err

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "meta.json").write_text(json.dumps({"format": "mtpserve-draft-data/2", "shards": []}))
    assert cli("train-draft", "--stage", "train", "--target", target_dir, "--device", "cpu", "--data-dir", empty) == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and "empty" in err

    none = tmp_path / "none"
    assert cli("train-draft", "--stage", "train", "--target", target_dir, "--device", "cpu", "--data-dir", none) == 2
    assert "--data-dir" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exc:
        cli("train-draft", "--stage", "data", "--target", target_dir, "--mix", "random=0")
    assert exc.value.code == 2 and "--mix" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli("train-draft", "--stage", "data", "--target", target_dir, "--mix", "poems=3")
    assert exc.value.code == 2 and "RECIPE=PARTS" in capsys.readouterr().err
    text = ["--mix", "chat=1", "--data-dir", tmp_path / "d0"]
    assert cli("train-draft", "--stage", "data", "--target", target_dir, "--device", "cpu", *text) == 2
    err = capsys.readouterr().err
    assert "--mix" in err and "need a tokenizer" in err

    for k in ("0", "-2"):
        with pytest.raises(SystemExit) as exc:
            cli("train-draft", "--target", target_dir, "--num-draft-tokens", k)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--num-draft-tokens" in err and "must be >= 1" in err


def test_help_describes_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """`train-draft --help` exits 0 and documents data, unrolling, and the outputs."""
    with pytest.raises(SystemExit) as exc:
        cli("train-draft", "--help")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("magpie", "--num-draft-tokens", "--resume", "--generator", "MODEL_CARD.md", "--time-budget"):
        assert needle in text
    for needle in ("--mix", "--shard", "--head-spec", "raw Python completion", "second turns"):
        assert needle in text
    data, settings, train, opts = DataConfig(), RecipeSettings(), TrainConfig(), TrainDraftOptions()
    for name, value in DEFAULTS.items():  # the parser's literal defaults mirror the dataclasses
        if name == "mix":
            value = _mix(str(value))
        want = getattr(data, name, getattr(settings, name, getattr(train, name, getattr(opts, name, None))))
        assert want == value, name


def test_dense_forward_matches_paged_model() -> None:
    """Dense target hidden states equal the paged forward; the unrolled head equals the paged K-chain."""
    torch.manual_seed(0)
    w = tiny_weights()
    model = LlamaModel(ARGS)
    model.load_hf_state_dict(w)
    model.eval()
    lens = [13, 7, 21]
    seqs = [torch.randint(0, ARGS.vocab_size, (n,)) for n in lens]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
    bs = 4
    with torch.no_grad():
        dense = target_hidden(model, ids)
        cache = model.allocate_cache(32, bs, "cpu")
        tables = [[b * 8 + j for j in range(8)] for b in range(len(lens))]
        meta = AttentionMetadata.build([0] * len(lens), lens, tables, bs)
        paged = model(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), cache, meta)
        flat = torch.cat([dense[i, :n] for i, n in enumerate(lens)])
        assert (flat - paged).abs().max().item() <= 1e-4
        assert dense.abs().mean().item() > 0.1  # not trivially zero

        # The draft chain as MTPEagleChain runs it: step 1 over positions 0..p from target hidden states,
        # then one row per later step at p+k-1 reading the previous step's hidden state.
        head = MTPEagleHead(ARGS)
        head.init_random(seed=3, std=0.2)
        head.eval()
        k = 3
        outs = head_unrolled(head, model, ids, dense, steps=k)
        s, h_t = seqs[2], dense[2]
        for p in (0, 6, 15):
            dcache = head.allocate_cache(8, bs, "cpu")
            table = list(range(8))
            m1 = AttentionMetadata.build([0], [p + 1], [table], bs)
            h1 = head(model.embed(s[1 : p + 2]), h_t[: p + 1], torch.arange(p + 1), dcache, m1)
            assert (h1 - outs[0][2, : p + 1]).abs().max().item() <= 1e-4
            h = h1[-1:]
            for j in range(2, k + 1):
                q = p + j - 1
                mj = AttentionMetadata.build([q], [1], [table], bs)
                h = head(model.embed(s[q + 1 : q + 2]), h, torch.tensor([q]), dcache, mj)
                assert (h - outs[j - 1][2, q : q + 1]).abs().max().item() <= 1e-4, (p, j)


def test_unroll_mask_structure() -> None:
    """Step 3, row q: step-1 keys at positions <= q-2, the step-2 key at q-1, and itself."""
    m = unroll_mask(5, 3)
    q = 4
    assert m[q, :5].tolist() == [True, True, True, False, False]
    assert m[q, 5:10].tolist() == [False, False, False, True, False]
    assert m[q, 10:].tolist() == [False, False, False, False, True]
    assert unroll_mask(5, 1).tolist() == torch.ones(5, 5, dtype=torch.bool).tril().tolist()


def test_hf_generator_matches_engine_greedy() -> None:
    """The GPU data-building fallback (HF generate) produces the engine's greedy tokens on CPU fp32."""
    w = tiny_weights()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in (5, 9, 14, 7)]
    settings = GenSettings(max_new_tokens=12, stop_ids=(2,))
    eng = EngineGenerator(ARGS, w, "cpu", "float32", batch_size=4, max_len=64).generate(prompts, settings)
    hf = HFGenerator(ARGS, w, "cpu", torch.float32, batch_size=4).generate(prompts, settings)
    assert [r.token_ids for r in eng] == [r.token_ids for r in hf]
    assert len({t for r in eng for t in r.token_ids}) > 10  # varied continuations, not one repeated token


def test_padding_to_a_width_multiple_leaves_the_loss_unchanged(data_dir: Path) -> None:
    """CUDA rounds batch widths up to a multiple of 64; the extra right padding must not change the loss."""
    from mtpserve.speculative.train.loss import unrolled_loss

    shared = build_shared(ARGS, tiny_weights(), "cpu", torch.float32)
    ds = load_dataset(data_dir)
    head = MTPEagleHead(ARGS)
    head.init_random(seed=3, std=0.1)
    losses = []
    for multiple in (1, 64):
        store = HiddenStore(shared, ds, torch.device("cpu"))
        store.pad_multiple = multiple
        batch = store.batch(list(range(6)))
        assert batch.ids.shape[1] % multiple == 0
        with torch.no_grad():
            loss, metrics = unrolled_loss(head, shared, batch, [1.0, 0.7, 0.5])
        losses.append((float(loss), metrics["acc1"]))
    assert abs(losses[0][0] - losses[1][0]) < 1e-5 and losses[0][1] == losses[1][1]


def test_vocab_stage_keeps_the_head_and_its_most_frequent_tokens(
    target_dir: Path, data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--stage vocab` writes the same head with the 64 tokens the training responses use most as its draft
    vocabulary (counted here independently), and refuses a missing head, an in-place rewrite and a size
    that is not smaller than the target's vocabulary, naming the flag."""
    src, out = tmp_path / "head.safetensors", tmp_path / "head-v64.safetensors"
    head = MTPEagleHead(ARGS)
    head.init_random(seed=3)
    head.save(src)
    base = ["train-draft", "--stage", "vocab", "--target", target_dir, "--device", "cpu", "--data-dir", data_dir,
            "--dev-fraction", DEV_FRACTION]  # fmt: skip
    assert cli(*base, "--head", src, "--out", out, "--draft-vocab", 64) == 0
    assert "draft vocabulary 64" in capsys.readouterr().out
    got = MTPEagleHead.load(out, ARGS)
    assert got.draft_vocab_size == 64 and got.feature_layers == head.feature_layers
    data = load_dataset(data_dir)
    train, _ = data.split(float(DEV_FRACTION), 0)
    counts = torch.zeros(ARGS.vocab_size, dtype=torch.long)
    for i in train:
        for t in data.ids[i][data.response_start[i] :].tolist():
            counts[t] += 1
    assert got.vocab_ids is not None
    kept = set(got.vocab_ids.tolist())
    assert min(int(counts[t]) for t in kept) >= max(int(counts[t]) for t in range(ARGS.vocab_size) if t not in kept)
    for name, value in head.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name
    for extra, flag in (([], "--head"), (["--head", src, "--out", src], "--out"),
                        (["--head", src, "--out", out, "--draft-vocab", 256], "--draft-vocab")):  # fmt: skip
        assert cli(*base, *extra) == 2
        assert flag in capsys.readouterr().err
