"""Launch tiles of the matrix-vector kernels (`fused_kernels`) per padded row count, and the tables chosen on
each GPU model by `bench/probes/gemv_tiles.py`.

A table reads `1=8x0,2=8x0r,4=4x2g2,16=8x0g4`: for steps of 1, 2, 3-4 and 9-16 rows, the output columns and
warps of a program (warps 0: 4 for inputs padded to at most 1,024, else 8), with `r` where a program reduces
the rows one at a time instead of in one product of every row (fewer registers), and `gN` where the step's
rows are split into groups of N, one program per group and output tile (each program reads its weight tile;
the other groups' copies come from L2). A row count the table leaves out keeps the default, `8x0`, up to 4
rows; steps of 5-32 rows take the kernels only where the table gives them tiles, in groups of at most 4 rows,
and cuBLAS otherwise. `model.gemv_tiles` picks `auto` (the table measured on this GPU model, else the
defaults), `default`, or a table of its own.

Tiles change the order in which a program sums a row's products. Where a verify step's rows are summed in
another order than a one-row decode step's, they round differently, and bf16 speculation may then emit
other greedy tokens than target-only decoding (`docs/design-notes.md`: the row loop did so once). So a table
enters TUNED only where the probe found the greedy tokens unchanged (`chosen_keeps_greedy_tokens`). Groups
of one row (`g1`) for every row count sum each row exactly as a one-row decode step does.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # padded rows of the steps the kernels take
GROUP_ROWS = (1, 2, 4)  # rows one program may hold: beyond 4 the register tiles lose to cuBLAS
GROUPED_ONLY = 8  # from this padded row count on, a table's tiles must split the rows into groups

# torch.cuda.get_device_name() -> the table bench/probes/gemv_tiles.py chose there (its `chosen_table`)
TUNED: dict[str, str] = {}


def padded_rows(rows: int) -> int:
    """A step's row count rounded up to a power of two: the row count a table's tiles are keyed by."""
    return 1 << max(rows - 1, 0).bit_length()


@dataclass(frozen=True)
class GemvTiles:
    """How the matrix-vector kernels split a step of one padded row count: output columns per program, warps
    per program (0: 4 for inputs padded to at most 1,024, else 8), whether rows are reduced one at a time, and
    the rows per program (`group`; 0: all of the step's rows in every program)."""

    block_n: int = 8
    warps: int = 0
    row_loop: bool = False
    group: int = 0

    def __post_init__(self) -> None:
        if self.block_n < 2 or self.block_n & (self.block_n - 1) or self.warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"tiles {self.text()}: output columns must be a power of two >= 2, warps 0-16")
        if self.group and self.group not in GROUP_ROWS:
            raise ValueError(f"tiles {self.text()}: groups of {'/'.join(map(str, GROUP_ROWS))} rows")

    @classmethod
    def parse(cls, text: str) -> GemvTiles:
        """`8x4` -> 8 output columns and 4 warps per program; `4x2r` reduces the rows one at a time; `8x0g2`
        gives each program 2 of the step's rows."""
        body, g, group = text.strip().lower().partition("g")
        try:
            block_n, warps = (int(v) for v in body.removesuffix("r").split("x"))
            rows = int(group) if g else 0
        except ValueError:
            raise ValueError(f"tiles '{text}' are not COLUMNSxWARPS[r][gROWS], e.g. 8x0, 4x2r or 8x0g2") from None
        return cls(block_n, warps, body.endswith("r"), rows)

    def text(self) -> str:
        """The tiles as `parse` reads them."""
        return f"{self.block_n}x{self.warps}{'r' if self.row_loop else ''}{f'g{self.group}' if self.group else ''}"

    def rows_per_program(self, rows: int) -> int:
        """Rows one program holds in a step of `rows` rows (padded to a power of two)."""
        padded = padded_rows(rows)
        return min(self.group, padded) if self.group else padded

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
        if int(rows) >= GROUPED_ONLY and not table[int(rows)].group:
            raise ValueError(f"'{item}': steps of {GROUPED_ONLY} or more rows need groups of at most 4 (gN)")
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
