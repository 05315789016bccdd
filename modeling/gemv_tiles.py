"""Launch tiles of the matrix-vector kernels (`fused_kernels`) per padded row count, and the tables chosen on
each GPU model by `bench/probes/gemv_tiles.py`.

A table reads `1=8x0,2=8x0r,4=4x2`: for steps of 1, 2 and 3-4 rows, the output columns and warps of a program
(warps 0: 4 for inputs padded to at most 1,024, else 8), with `r` where a program reduces the rows one at a
time instead of in one product of every row (fewer registers). A row count the table leaves out keeps the
default, `8x0`. `model.gemv_tiles` picks `auto` (the table measured on this GPU model, else the defaults),
`default`, or a table of its own.

Tiles change the order in which a program sums a row's products. Where a verify step's rows are summed in
another order than a one-row decode step's, they round differently, and bf16 speculation may then emit
other greedy tokens than target-only decoding (`docs/design-notes.md`: the row loop did so once). So a table
enters TUNED only where the probe found the greedy tokens unchanged (`chosen_keeps_greedy_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_COUNTS = (1, 2, 4)  # padded rows of the steps the kernels take (at most fused_kernels.GEMV_MAX_ROWS)

# torch.cuda.get_device_name() -> the table bench/probes/gemv_tiles.py chose there (its `chosen_table`)
TUNED: dict[str, str] = {}


@dataclass(frozen=True)
class GemvTiles:
    """How the matrix-vector kernels split a step of one padded row count: output columns per program, warps
    per program (0: 4 for inputs padded to at most 1,024, else 8), and whether rows are reduced one at a time."""

    block_n: int = 8
    warps: int = 0
    row_loop: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 2 or self.block_n & (self.block_n - 1) or self.warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"tiles {self.text()}: output columns must be a power of two >= 2, warps 0-16")

    @classmethod
    def parse(cls, text: str) -> GemvTiles:
        """`8x4` -> 8 output columns and 4 warps per program; `4x2r` reduces the rows one at a time."""
        body = text.strip().lower()
        try:
            block_n, warps = (int(v) for v in body.removesuffix("r").split("x"))
        except ValueError:
            raise ValueError(f"tiles '{text}' are not COLUMNSxWARPS[r], e.g. 8x0 or 4x2r") from None
        return cls(block_n, warps, body.endswith("r"))

    def text(self) -> str:
        """The tiles as `parse` reads them."""
        return f"{self.block_n}x{self.warps}{'r' if self.row_loop else ''}"

    def num_warps(self, block_k: int) -> int:
        """Warps per program for inputs padded to block_k."""
        return self.warps or (4 if block_k <= 1024 else 8)


def parse_table(text: str) -> dict[int, GemvTiles]:
    """`1=8x0,4=4x2r` -> tiles by padded row count; ValueError naming what is wrong."""
    table: dict[int, GemvTiles] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        rows, eq, tiles = item.partition("=")
        if not eq or not rows.strip().isdigit() or int(rows) not in ROW_COUNTS:
            raise ValueError(f"'{item}' is not ROWS=TILES with ROWS one of {ROW_COUNTS}")
        table[int(rows)] = GemvTiles.parse(tiles)
    return table


def table_text(table: dict[int, GemvTiles]) -> str:
    """A table as `parse_table` reads it."""
    return ",".join(f"{rows}={table[rows].text()}" for rows in sorted(table))


def resolve(setting: str, device_name: str | None) -> dict[int, GemvTiles]:
    """The table `model.gemv_tiles` asks for on a device named `device_name` (None off CUDA)."""
    if setting == "default":
        return {}
    if setting == "auto":
        return parse_table(TUNED.get(device_name or "", ""))
    return parse_table(setting)
