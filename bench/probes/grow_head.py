"""Write a draft head grown to more decoder layers (or a wider MLP) that still drafts exactly what it did.

The extra layers start as copies of the head's last layer with zero output projections, the extra MLP
units with zero down-projection columns (`MTPEagleHead.init_from_head`), so acceptance is unchanged and a
benchmark of the grown file measures only what the larger head costs per step:

    python3 bench/probes/grow_head.py --head speculative/heads/smollm2-135m-mtp.safetensors --decoder 2 \\
        --out deep.safetensors
    python3 bench/gpu.py --model M --draft deep.safetensors --groups decode --skip-hf --ks 1,3 --batches 1,64 \\
        --variants none --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from safetensors import safe_open

from mtpserve.modeling.loader import resolve_model
from mtpserve.speculative.mtp_head import MAX_LAYERS, MTPEagleHead


def grow(head: MTPEagleHead, decoder: int, mlp: int | None) -> MTPEagleHead:
    """`head` with `decoder` decoder layers and an MLP of width `mlp` (None: unchanged), same drafts."""
    big = MTPEagleHead(head.args, **{**head.layout(), "mlp_size": mlp or head.mlp_size, "num_layers": decoder})
    big.init_from_head(head)
    return big


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="the draft head file to grow")
    ap.add_argument("--model", default=None, help="its target (default: the packaged SmolLM2)")
    ap.add_argument("--decoder", type=int, default=2, help=f"decoder layers of the grown head (1-{MAX_LAYERS})")
    ap.add_argument("--mlp", type=int, default=None, help="MLP width of the grown head (default: unchanged)")
    ap.add_argument("--out", required=True, help="where to write the grown head")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, grow the head, write it in bf16 with the source's metadata."""
    ap = build_parser()
    args = ap.parse_args(argv)
    target = resolve_model(args.model).args()
    head = MTPEagleHead.load(args.head, target)
    try:
        big = grow(head, args.decoder, args.mlp)
    except ValueError as exc:
        ap.error(str(exc))
    with safe_open(args.head, framework="pt") as f:
        meta = dict(f.metadata() or {})
    meta["grown_from"] = (
        f"{Path(args.head).name}: decoder {head.num_layers} -> {big.num_layers}, mlp {head.mlp_size} -> {big.mlp_size}"
    )
    big.save(args.out, meta, torch.bfloat16)
    print(f"wrote {args.out}: {big.num_layers} decoder layer(s), MLP {big.mlp_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
