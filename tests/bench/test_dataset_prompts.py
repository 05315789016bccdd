"""`bench/probes/dataset_prompts.py`: a dataset's prompts as a prompts file the acceptance bench sends unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.probes.dataset_prompts import main, prompt_records
from mtpserve.cluster.bench.acceptance import encode_texts, load_prompt_records
from mtpserve.speculative.train.data import TokenDataset, chat_prompt_ids
from tests.helpers.smol import smollm2


def test_records_round_trip_to_the_dataset_prompt_ids(tmp_path: Path) -> None:
    """Chat, raw and two-turn prompts come back as the exact ids the dataset holds; ids that no text encodes
    to (a word split into pieces the tokenizer would not choose) are skipped."""
    tok = smollm2()[3]
    chats = ["How do tides work?", "Give me  two\nlines about rain, please."]
    raw = "def area(r):\n    return"
    conv = tok.apply_chat_template(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [chat_prompt_ids(tok, t) for t in chats]
    prompts += [tok.encode(raw, add_special_tokens=False), tok.encode(conv, add_special_tokens=False)]
    pieces = tok.encode("light", add_special_tokens=False) + tok.encode("house", add_special_tokens=False)
    assert tok.encode("lighthouse", add_special_tokens=False) != pieces
    ds = TokenDataset(
        [torch.tensor([*p, 42, 43]) for p in [*prompts, pieces]],
        [len(p) for p in [*prompts, pieces]],
        [True] * 5,
        ["chat", "chat", "code", "multi", "code"],
    )
    records, skipped = prompt_records(ds, tok)
    assert skipped == 1 and [r["category"] for r in records] == ["chat", "chat", "code", "multi"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    back = load_prompt_records(path)
    assert [chat for _, chat in back] == [True, True, False, True]
    ids = [encode_texts(tok, [text], chat)[0] for text, chat in back]
    assert ids == prompts


def test_unreadable_dataset_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder without a dataset is refused with the reason."""
    assert main([str(tmp_path), "--out", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "meta.json" in err and not (tmp_path / "p.jsonl").exists()
