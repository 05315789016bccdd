"""A reduced draft vocabulary for an existing head, without training: its lm_head keeps only the target
tokens that occur most often in the dataset's responses (what the draft must predict).

The draft then scores a fraction of the lm_head rows per draft step; a target token outside the subset
can still be emitted (the target's own verify and bonus tokens are unrestricted), it just cannot be
drafted. Output stays lossless; only the acceptance of rare tokens drops.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.train.data import TokenDataset
from mtpserve.speculative.train.errors import TrainSetupError
from mtpserve.speculative.train.heads import frequent_vocab, response_token_counts

DRAFT_VOCAB_KEY = "draft_vocab_coverage"


def restrict_vocab(
    head_path: Path,
    out: Path,
    size: int,
    args: LlamaArgs,
    data: TokenDataset,
    indices: list[int],
    command: str = "",
) -> dict[str, Any]:
    """Write `head_path`'s head to `out` with the `size` most frequent response tokens of `indices` as its
    draft vocabulary; returns the size, the share of response tokens it covers and the paths."""
    if not head_path.is_file():
        raise TrainSetupError("--head", f"'{head_path}' is not a file")
    if out.resolve() == head_path.resolve():
        raise TrainSetupError("--out", "must differ from --head (the head is rewritten, not edited in place)")
    if not 0 < size < args.vocab_size:
        raise TrainSetupError("--draft-vocab", f"must be in [1, {args.vocab_size - 1}] (the target's vocabulary is "
                              f"{args.vocab_size}), got {size}")  # fmt: skip
    if not indices:
        raise TrainSetupError("--data-dir", "has no training sequences to count tokens in")
    old = MTPEagleHead.load(head_path, args)
    ids, coverage = frequent_vocab(response_token_counts(data, indices, args.vocab_size), size)
    new = MTPEagleHead(args, **{**old.layout(), "vocab_ids": ids})
    state = {k: v for k, v in old.state_dict().items() if k != "vocab_ids"}
    new.load_state_dict({**state, "vocab_ids": ids})
    with safe_open(str(head_path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        dtype = f.get_tensor(next(k for k in f.keys() if k.endswith("eh_proj.weight"))).dtype  # noqa: SIM118
    meta |= {DRAFT_VOCAB_KEY: f"{coverage:.6f}", "draft_vocab_from": json.dumps({"head": head_path.name,
             "sequences": len(indices), "command": command})}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    new.save(out, meta, dtype)
    return {"head": str(out), "from": str(head_path), "draft_vocab": size, "coverage": coverage,
            "sequences": len(indices)}  # fmt: skip
