"""A draft head's acceptance on a dataset's greedy answers cut at several lengths, beside the share of
response tokens that repeat an 8-gram earlier in their answer.

Long greedy answers of a small target fall into loops that are easy to draft, so a figure over whole
answers reads above what the start of an answer gets. This shows how much, per cut:

    python3 bench/probes/answer_length.py DATA_DIR --head speculative/heads/smollm2-135m-mtp.safetensors \\
        --cuts 64,132,256,0 --json bench/results/cpu_answer_length.json

A cut of 0 keeps whole answers. Sequences are scored teacher-forced, as `train-draft --stage eval` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from mtpserve.modeling.loader import resolve_model
from mtpserve.speculative.mtp_head import MTPEagleHead
from mtpserve.speculative.train.batches import HiddenStore, pad_ids
from mtpserve.speculative.train.data import TokenDataset, load_dataset
from mtpserve.speculative.train.eval import evaluate
from mtpserve.speculative.train.loss import repeated_tokens
from mtpserve.speculative.train.trainer import build_shared


def cut_answers(data: TokenDataset, cut: int) -> TokenDataset:
    """The dataset with every answer cut to its first `cut` tokens (0: unchanged)."""
    ids = [t[: r + cut] if cut else t for t, r in zip(data.ids, data.response_start, strict=True)]
    return TokenDataset(ids, list(data.response_start), list(data.greedy), list(data.source), meta=dict(data.meta))


def measure(data: TokenDataset, head: MTPEagleHead, shared: Any, cuts: list[int], k: int) -> dict[str, Any]:
    """Per cut: acceptance along the decoding path and over every position, per source, and the repeat share."""
    out: dict[str, Any] = {}
    for cut in cuts:
        d = cut_answers(data, cut)
        store = HiddenStore(shared, d, torch.device("cpu"), keep=False, layers=head.feature_layers)
        idx = list(range(len(d)))
        res = evaluate(head, shared, store, indices=idx, k=k, batch_size=8)
        lengths, starts = torch.tensor(d.lengths()), torch.tensor(d.response_start)
        repeats = int(repeated_tokens(pad_ids(d.ids, "cpu"), lengths, starts).sum())
        responses = int((lengths - starts).sum())
        out[str(cut)] = {
            "decoding_path": res["online_acceptance_length"],
            "every_position": res["acceptance_length"],
            "by_source": {s: v["online_acceptance_length"] for s, v in res["by_source"].items()},
            "repeated_share": repeats / max(1, responses),
            "response_tokens": responses,
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir", help="a draft dataset (`train-draft --stage data`) with greedy answers")
    ap.add_argument("--head", required=True, help="the draft head to score")
    ap.add_argument("--model", default=None, help="the target (default: the packaged SmolLM2)")
    ap.add_argument("--cuts", default="64,132,256,0", help="answer lengths to cut at; 0 keeps whole answers")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="where to write the figures")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, score the head at every cut, print a table and write the JSON."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        cuts = [int(c) for c in args.cuts.split(",")]
    except ValueError:
        ap.error(f"--cuts must be comma-separated integers, got {args.cuts!r}")
    if any(c < 0 for c in cuts):
        ap.error("--cuts must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    src = resolve_model(args.model)
    target = src.args()
    shared = build_shared(target, src.weights(), "cpu", torch.float32)
    head = MTPEagleHead.load(args.head, target)
    figures = measure(load_dataset(args.data_dir), head, shared, cuts=cuts, k=args.num_draft_tokens)
    print("| answer tokens | AL, decoding path | AL, every position | repeated 8-gram share | response tokens |")
    print("|---|---|---|---|---|")
    for cut, f in figures.items():
        print(
            f"| {cut if cut != '0' else 'whole'} | {f['decoding_path']:.3f} | {f['every_position']:.3f} | "
            f"{f['repeated_share']:.3f} | {f['response_tokens']} |"
        )
    if args.json:
        report = {"command": " ".join(["python", "bench/answer_length.py", *(argv or sys.argv[1:])]), "cuts": figures}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
