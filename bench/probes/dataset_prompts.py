"""The prompts of a `mtpserve train-draft` dataset as a prompts file for `mtpserve bench acceptance`.

Decoding online on prompts of the training distribution (a dataset built with a seed the head never saw)
separates what the prompts' register costs from what the head cannot do on its own kind of data:

    mtpserve train-draft --stage data --mix chat=1,steered=1,magpie=1 --part-size 40 --seed 7 \\
        --data-dir /tmp/d7 --max-new-tokens 132 --sampled-fraction 0 --device cpu
    python3 bench/probes/dataset_prompts.py /tmp/d7 --out /tmp/d7.jsonl
    mtpserve bench acceptance --prompts /tmp/d7.jsonl --prompts bench/prompts/chat_dev.jsonl --device cpu

Chat prompts become `prompt` records (a conversation of several turns keeps the template's turn markers
in its text, which the bench renders back to the same ids); prompts without the chat template become
`"format": "raw"` records. A record is written only when the bench would send exactly the dataset's ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpserve.modeling.errors import ModelLoadError
from mtpserve.modeling.loader import resolve_model
from mtpserve.speculative.train.data import TokenDataset, chat_prompt_ids, load_dataset
from mtpserve.speculative.train.errors import TrainSetupError

_MARK = "\u2063PROMPT\u2063"


def prompt_records(data: TokenDataset, tokenizer: Any) -> tuple[list[dict[str, str]], int]:
    """(one record per usable sequence: id, category = recipe, prompt [, format raw]; sequences skipped)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False
    )
    head, tail = rendered.split(_MARK, 1)
    records: list[dict[str, str]] = []
    skipped = 0
    for i, (ids, start, source) in enumerate(zip(data.ids, data.response_start, data.source, strict=True)):
        prompt_ids = [int(t) for t in ids[:start]]
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        record = {"id": f"{source}-{i}", "category": source}
        if text.startswith(head) and text.endswith(tail):
            content = text[len(head) : len(text) - len(tail)]
            if chat_prompt_ids(tokenizer, content) != prompt_ids:
                skipped += 1
                continue
            records.append({**record, "prompt": content})
        elif [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] == prompt_ids:
            records.append({**record, "prompt": text, "format": "raw"})
        else:
            skipped += 1
    return records, skipped


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir", help="a dataset folder written by `mtpserve train-draft --stage data`")
    ap.add_argument("--out", required=True, help="prompts file to write (JSON lines)")
    ap.add_argument("--model", default=None, help="the target whose tokenizer built the dataset (default: SmolLM2)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Write the prompts file; exit 2 with the reason when the dataset or the model cannot be read."""
    args = build_parser().parse_args(argv)
    try:
        data = load_dataset(args.data_dir)
        tokenizer = resolve_model(args.model).tokenizer()
    except (TrainSetupError, ModelLoadError, OSError) as exc:
        print(f"dataset_prompts: {exc}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print("dataset_prompts: --model: the target has no tokenizer, so its prompts are token ids", file=sys.stderr)
        return 2
    records, skipped = prompt_records(data, tokenizer)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {args.out} ({skipped} skipped: no text encodes to their ids)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
