"""The draft dataset builder and the side-by-side trainer on a tiny random Llama (no tokenizer: the
`random` recipe): parts are deterministic, resumable and shardable; heads trained side by side equal heads
trained alone; the epoch order caps padded tokens; head specs and vocabularies are checked."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from mtpserve.cluster.cli.train_generator import EngineGenerator
from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.train.batches import epoch_batches
from mtpserve.speculative.train.data import DataConfig, build_parts, load_dataset, part_path
from mtpserve.speculative.train.errors import TrainSetupError
from mtpserve.speculative.train.heads import HeadSpec, frequent_vocab, parse_head_spec, response_token_counts
from mtpserve.speculative.train.recipes import RecipeSettings, completion_prompt, documented_functions
from mtpserve.speculative.train.trainer import TrainConfig, Trainer
from tests.helpers.tiny import tiny_args, tiny_weights


@pytest.fixture(scope="module")
def target() -> tuple[LlamaArgs, dict[str, torch.Tensor]]:
    """A 3-layer tiny target, so heads can fuse layers 1 and 2."""
    args = tiny_args(num_hidden_layers=3, vocab_size=128, max_position_embeddings=256)
    return args, tiny_weights(args)


@pytest.fixture(scope="module")
def generator(target: tuple[LlamaArgs, dict[str, torch.Tensor]]) -> EngineGenerator:
    args, w = target
    return EngineGenerator(args, w, "cpu", "float32", batch_size=8, max_len=64)


def config(parts: int = 3, seed: int = 0) -> DataConfig:
    return DataConfig(mix={"random": parts}, part_size=5, settings=RecipeSettings(max_new_tokens=10), seed=seed)


def read_ids(root: Path) -> list[list[int]]:
    return [t.tolist() for t in load_dataset(root).ids]


def test_parts_are_deterministic_and_shards_build_the_same_data(
    tmp_path: Path, target: tuple[LlamaArgs, dict[str, torch.Tensor]], generator: EngineGenerator
) -> None:
    args, _ = target
    status = build_parts(tmp_path / "a", generator, None, args, cfg=config())
    assert status["complete"] and status["parts_done"] == 3 and status["built_now"] == 3
    assert build_parts(tmp_path / "b", generator, None, args, cfg=config())["complete"]
    for w in (1, 0):  # two shards, run one after the other
        status = build_parts(tmp_path / "s", generator, None, args, cfg=config(), shard=(w, 2))
    assert status["complete"]
    a = read_ids(tmp_path / "a")
    assert a == read_ids(tmp_path / "b") == read_ids(tmp_path / "s")
    assert len(a) == 15 and len({tuple(x) for x in a}) == 15
    build_parts(tmp_path / "c", generator, None, args, cfg=config(seed=1))
    assert read_ids(tmp_path / "c") != a


def test_a_cut_short_build_continues_where_it_stopped(
    tmp_path: Path, target: tuple[LlamaArgs, dict[str, torch.Tensor]], generator: EngineGenerator
) -> None:
    args, _ = target
    root = tmp_path / "d"
    late = build_parts(root, generator, None, args, cfg=config(), deadline=time.time() - 1)
    assert late == {"complete": False, "parts_done": 0, "parts_total": 3, "built_now": 0}, "past the deadline"
    first = build_parts(root, generator, None, args, cfg=config(), shard=(0, 3))
    assert first == {"complete": False, "parts_done": 1, "parts_total": 3, "built_now": 1}
    assert not (root / "meta.json").exists()
    with pytest.raises(TrainSetupError, match=r"--data-dir.*finish it"):
        load_dataset(root)
    kept = part_path(root, "random", 0).stat().st_mtime_ns
    again = build_parts(root, generator, None, args, cfg=config())
    assert again["complete"] and again["built_now"] == 2
    assert part_path(root, "random", 0).stat().st_mtime_ns == kept, "a finished part is not rebuilt"
    build_parts(tmp_path / "ref", generator, None, args, cfg=config())
    assert read_ids(root) == read_ids(tmp_path / "ref")


def test_parts_of_other_settings_are_refused(
    tmp_path: Path, target: tuple[LlamaArgs, dict[str, torch.Tensor]], generator: EngineGenerator
) -> None:
    args, _ = target
    build_parts(tmp_path, generator, None, args, cfg=config(), shard=(0, 3))
    with pytest.raises(TrainSetupError, match=r"--data-dir.*other settings"):
        build_parts(tmp_path, generator, None, args, cfg=config(seed=5))
    with pytest.raises(TrainSetupError, match=r"--mix.*need a tokenizer"):
        build_parts(tmp_path / "t", generator, None, args, cfg=DataConfig(mix={"code": 1}))


def test_heads_trained_side_by_side_equal_heads_trained_alone(
    tmp_path: Path, target: tuple[LlamaArgs, dict[str, torch.Tensor]], generator: EngineGenerator
) -> None:
    """Same batches, independent optimizers: sharing a run changes nothing for any head."""
    args, w = target
    build_parts(tmp_path, generator, None, args, cfg=config(parts=4))
    data = load_dataset(tmp_path)
    specs = [
        HeadSpec("plain"),
        HeadSpec("fused", layers="fused"),
        HeadSpec("small", layers="1/2", draft_vocab=40),
        HeadSpec("k1", layers="fused", num_draft_tokens=1),
        HeadSpec("path", layers="fused", path=2.0),
        HeadSpec("rep", layers="fused", repeat=0.0),
    ]

    def train(heads: list[HeadSpec]) -> Trainer:
        cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, eval_every=0, ckpt_every=0, dev_fraction=0.2, heads=heads)
        trainer = Trainer(cfg, args, w, data)
        trainer.run()
        return trainer

    together = train(specs)
    for run in together.runs:
        alone = train([run.spec]).runs[0]
        for (name, a), b in zip(run.head.state_dict().items(), alone.head.state_dict().values(), strict=True):
            assert torch.allclose(a, b, atol=1e-6), (run.spec.name, name)
    small = together.runs[2].head
    assert small.feature_layers == (1, 2) and small.draft_vocab_size == 40 and together.runs[2].vocab_coverage
    assert together.runs[3].weights == [1.0] and len(together.runs[0].weights) == 3
    res = together.results(together.evaluate())
    assert set(res["heads"]) == {"plain", "fused", "small", "k1", "path", "rep"} and res["best"] in res["heads"]
    fused, path = together.runs[1].head.state_dict(), together.runs[4].head.state_dict()
    assert any(not torch.equal(fused[n], path[n]) for n in fused), "the path weight changes what the head learns"
    assert "decoding-path chains x3" in res["heads"]["path"]["description"]
    assert res["dev"] == res["heads"][res["best"]]["dev"]


def test_best_head_prefers_a_cheaper_head_within_the_margin(
    tmp_path: Path, target: tuple[LlamaArgs, dict[str, torch.Tensor]], generator: EngineGenerator
) -> None:
    """Within the margin a head with fewer decoder layers wins, then one with a smaller draft vocabulary."""
    args, w = target
    build_parts(tmp_path, generator, None, args, cfg=config(parts=2))
    heads = [HeadSpec("full"), HeadSpec("small", draft_vocab=50), HeadSpec("deep", decoder=2)]
    cfg = TrainConfig(steps=0, eval_every=0, ckpt_every=0, heads=heads)
    trainer = Trainer(cfg, args, w, load_dataset(tmp_path))
    assert [r.head.num_layers for r in trainer.runs] == [1, 1, 2]
    al = {n: {"first_acceptance_length": v} for n, v in (("full", 2.000), ("small", 1.995), ("deep", 2.004))}
    assert trainer.best(al) == "small"
    al["small"]["first_acceptance_length"] = 1.95
    assert trainer.best(al) == "full", "the deeper head is within the margin, so the shallower one wins"
    al["deep"]["first_acceptance_length"] = 2.02
    assert trainer.best(al) == "deep"


def test_frequent_vocab_keeps_the_commonest_response_tokens(
    tmp_path: Path, target: tuple[LlamaArgs, dict[str, torch.Tensor]], generator: EngineGenerator
) -> None:
    args, _ = target
    build_parts(tmp_path, generator, None, args, cfg=config(parts=2))
    data = load_dataset(tmp_path)
    counts = response_token_counts(data, list(range(len(data))), args.vocab_size)
    assert int(counts.sum()) == sum(int(t.numel()) - r for t, r in zip(data.ids, data.response_start, strict=True))
    ids, coverage = frequent_vocab(counts, 20)
    assert ids.tolist() == sorted(ids.tolist()) and len(ids) == 20
    assert int(counts[ids].min()) >= int(counts[[i for i in range(args.vocab_size) if i not in ids]].max())
    assert coverage == pytest.approx(int(counts[ids].sum()) / int(counts.sum()))
    assert frequent_vocab(counts, args.vocab_size)[1] == 1.0


def test_epoch_batches_cap_padded_tokens_and_cover_every_sequence() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(5, 200) for _ in range(300)]
    batches = epoch_batches(list(range(300)), lengths, 16, seed=1, epoch=0, max_tokens=600)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(len(b) <= 16 and (len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 600) for b in batches)
    assert batches == epoch_batches(list(range(300)), lengths, 16, seed=1, epoch=0, max_tokens=600)
    assert max(len(b) for b in epoch_batches(list(range(300)), lengths, 16, 1, epoch=0)) == 16


@pytest.mark.parametrize(
    ("text", "message"),
    [("x:layers=top", "layers must be"), ("x:vocab=big", "vocab must be an integer"), ("x:k=0", "k >= 1"),
     ("x:depth=2", "unknown key"), ("bad name:k=1", "the name"), ("x:path=much", "path must be a number"),
     ("x:path=-1", r"path must be in \[0, 100\]"), ("x:decoder=0", r"decoder must be in \[1, 4\]"),
     ("x:decoder=two", "decoder must be an integer"), ("x:repeat=-0.5", r"repeat must be in \[0, 100\]")],
)  # fmt: skip
def test_bad_head_specs_name_the_flag(text: str, message: str, target: tuple[LlamaArgs, dict]) -> None:
    with pytest.raises(TrainSetupError, match=message) as exc:
        parse_head_spec(text).feature_layers(target[0])
    assert exc.value.field == "--head-spec"
    for text in ("v:layers=fused,vocab=64,k=2", "p:layers=fused,path=1.5", "d:layers=fused,decoder=2", "r:repeat=0.25"):
        spec = parse_head_spec(text)
        assert parse_head_spec(spec.text()) == spec
    assert parse_head_spec("p:path=1.5").path == 1.5


def test_code_prompts_cut_real_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        'import os\n\n\nclass A:\n    def area(self, w: int, h: int) -> int:\n        """Width times height."""\n'
        "        total = w * h\n        return total\n\n\ndef plain():\n    return 1\n"
    )
    (found,) = documented_functions(src)
    head, func = found
    assert head.startswith("import os") and func.lstrip().startswith("def area")
    outs = {completion_prompt(head, func, random.Random(s)) for s in range(20)}
    stub = head + 'def area(self, w: int, h: int) -> int:\n    """Width times height."""\n    '
    assert stub in outs, "the stub ends at the body's indentation"
    whole = head + "def area(self, w: int, h: int) -> int:\n" + '    """Width times height."""\n'
    whole += "    total = w * h\n    return total\n"
    cut = [o for o in outs if o != stub]
    assert cut and all(o.endswith("\n") and whole.startswith(o) and o != whole for o in cut)
    assert any("total = w * h" in o for o in cut), "some prompts stop inside the body"
