"""Tiles of the matrix-vector kernels: the table format, what `model.gemv_tiles` picks, and that a built
model's kernels use it (the kernels' results with other tiles are in test_fused_kernels.py)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from mtpserve.cluster.cli.common import add_engine_flags, config_from_args
from mtpserve.modeling import fused_kernels, gemv_tiles
from mtpserve.modeling.attention import ragged_metadata
from mtpserve.modeling.gemv_tiles import GemvTiles, parse_table, resolve, table_text
from mtpserve.workers.builders import build_target
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.tiny import tiny_args, tiny_weights


def test_a_table_reads_and_writes_back() -> None:
    """Row counts 1, 2 and 4 take COLUMNSxWARPS[r]; a table writes back as it reads; a row count left out
    takes the default tiles."""
    table = parse_table("4=4x2r, 1=16x8")
    assert table == {1: GemvTiles(16, 8), 4: GemvTiles(4, 2, row_loop=True)}
    assert table_text(table) == "1=16x8,4=4x2r" and parse_table(table_text(table)) == table
    assert (
        GemvTiles().num_warps(1024) == 4 and GemvTiles().num_warps(2048) == 8 and GemvTiles(8, 2).num_warps(2048) == 2
    )
    assert parse_table("") == {}


@pytest.mark.parametrize(
    ("text", "reason"),
    [("3=8x0", "ROWS one of"), ("1:8x0", "not ROWS=TILES"), ("1=8", "not COLUMNSxWARPS"), ("2=6x0", "power of two"),
     ("2=8x3", "warps 0-16"), ("1=1x0", "power of two")],
)  # fmt: skip
def test_bad_tables_are_refused_naming_the_item(text: str, reason: str) -> None:
    """Each bad item is refused with what is wrong with it."""
    with pytest.raises(ValueError, match=reason):
        parse_table(text)


def test_auto_takes_the_table_measured_on_this_gpu_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto`: the GPU model's tuned table, else the defaults (also off CUDA); `default`: the defaults even
    where a table was measured; an explicit table wins."""
    monkeypatch.setattr(gemv_tiles, "TUNED", {"NVIDIA H100 80GB HBM3": "2=8x0r,4=4x2"})
    assert resolve("auto", "NVIDIA H100 80GB HBM3") == {2: GemvTiles(8, 0, True), 4: GemvTiles(4, 2)}
    assert resolve("auto", "NVIDIA H200") == {} and resolve("auto", None) == {}
    assert resolve("default", "NVIDIA H100 80GB HBM3") == {}
    assert resolve("1=4x1", "NVIDIA H100 80GB HBM3") == {1: GemvTiles(4, 1)}


def test_the_config_names_the_field_and_the_model_build_applies_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad `model.gemv_tiles` (in a config or from `--gemv-tiles`) is refused naming the field; building a
    target sets the process's tiles from it (so every later launch uses them), and `default` puts the
    defaults back; the choice is the model's, so two models in one process keep their own."""
    with pytest.raises(ValidationError, match=r"model\.gemv_tiles"):
        MTPServeConfig.from_dict({"model": {"gemv_tiles": "2=8x"}})
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert config_from_args(p.parse_args(["--gemv-tiles", "4=4x2r"])).model.gemv_tiles == "4=4x2r"
    assert config_from_args(p.parse_args([])).model.gemv_tiles == "auto"
    with pytest.raises(SystemExit):
        config_from_args(p.parse_args(["--gemv-tiles", "5=8x0"]))
    assert "model.gemv_tiles" in capsys.readouterr().err
    args = tiny_args()
    tuned = build_target(args, tiny_weights(args), torch.float32, "cpu", gemv_tiles="4=4x2r")
    plain = build_target(args, tiny_weights(args), torch.float32, "cpu", gemv_tiles="default")
    assert fused_kernels.gemv_tiles(3) == GemvTiles(), "building a model changes nothing outside its runs"
    seen: list[tuple[GemvTiles, GemvTiles]] = []
    for model in (tuned, plain):
        real = model.layers[0].step

        def spy(*a: Any, real: Any = real, **k: Any) -> Any:
            seen.append((fused_kernels.gemv_tiles(3), fused_kernels.gemv_tiles(1)))
            return real(*a, **k)

        monkeypatch.setattr(model.layers[0], "step", spy)
        cache = model.allocate_cache(4, 16, "cpu")
        meta = ragged_metadata([0], [3], [[0]], 16, device="cpu")
        model.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache, meta)
    assert seen == [(GemvTiles(4, 2, True), GemvTiles()), (GemvTiles(), GemvTiles())]
