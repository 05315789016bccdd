"""Host time of building the ragged attention metadata of one eager step (the CPU / masked-SDPA path).

python bench/metadata_build.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modeling.attention import AttentionMetadata

CASES = {  # name: (sequences, context before the step, new rows per sequence)
    "decode_b64_ctx256": (64, 256, 1),
    "verify_b64_k3_ctx256": (64, 256, 4),
    "decode_b8_ctx1000": (8, 1000, 1),
    "chunk_512_plus_63_decodes": (64, 256, 1),
}
BLOCK = 16


def case_args(name: str) -> tuple[list[int], list[int], list[list[int]]]:
    """(starts, new rows, block tables) of a case; the last case puts a 512-token chunk in row 0."""
    b, ctx, n = CASES[name]
    starts, counts = [ctx] * b, [n] * b
    if name.startswith("chunk"):
        starts[0], counts[0] = 0, 512
    per = -(-max(s + c for s, c in zip(starts, counts, strict=True)) // BLOCK)
    return starts, counts, [list(range(i * per, (i + 1) * per)) for i in range(b)]


def main() -> None:
    """Time each case (mean of 50 builds after 3 warm-up builds), print ms and write them as JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()
    out: dict[str, float] = {}
    for name in CASES:
        built = case_args(name)
        for _ in range(3):
            AttentionMetadata.build(*built, BLOCK)
        t = time.perf_counter()
        for _ in range(50):
            AttentionMetadata.build(*built, BLOCK)
        out[name] = round((time.perf_counter() - t) / 50 * 1e3, 3)
        print(f"{name:28s} {out[name]:8.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "ms_per_build": out}, indent=2))


if __name__ == "__main__":
    main()
