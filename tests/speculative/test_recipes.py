"""Every text recipe on the real SmolLM2 (CPU, short answers): what each kind of sample looks like."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpserve.cluster.cli.train_generator import EngineGenerator
from mtpserve.speculative.train import prompt_parts
from mtpserve.speculative.train.data import DataConfig, build_parts, load_dataset
from mtpserve.speculative.train.openers import OPENERS
from mtpserve.speculative.train.recipes import RecipeSettings
from mtpserve.speculative.train.seed_prompts import SEED_PROMPTS
from tests.helpers.smol import smollm2

pytestmark = pytest.mark.slow
MIX = {"chat": 1, "open": 1, "steered": 1, "magpie": 1, "math": 1, "code": 1, "long": 1, "multi": 1, "seed": 1}


def test_each_recipe_builds_its_kind_of_sample(tmp_path: Path) -> None:
    _, args, weights, tok = smollm2()
    gen = EngineGenerator(args, weights, "cpu", "float32", batch_size=16, max_len=320)
    settings = RecipeSettings(
        max_new_tokens=12, long_max_new_tokens=20, code_max_new_tokens=12, prompt_max_tokens=40, oversample=3.0
    )
    status = build_parts(tmp_path, gen, tok, args, cfg=DataConfig(mix=MIX, part_size=4, settings=settings, seed=2))
    assert status["complete"]
    ds = load_dataset(tmp_path)
    texts: dict[str, list[tuple[str, str, int]]] = {}
    for ids, start, src in zip(ds.ids, ds.response_start, ds.source, strict=True):
        prompt = tok.decode(ids[:start].tolist(), skip_special_tokens=False)
        answer = tok.decode(ids[start:].tolist(), skip_special_tokens=False)
        texts.setdefault(src, []).append((prompt, answer, int(ids.numel()) - start))
    assert set(texts) == set(MIX), f"every recipe yields samples: {sorted(texts)}"
    users = {src: [p.split("<|im_start|>user\n")[-1] for p, _, _ in rows] for src, rows in texts.items()}
    for src, rows in texts.items():
        for prompt, _, n in rows:
            cap = {"long": 20, "code": 12}.get(src, 12)
            assert 2 <= n <= cap
            if src == "code":
                assert "<|im_start|>" not in prompt and "def " in prompt, "raw completion, no chat template"
            else:
                assert prompt.endswith("<|im_start|>assistant\n")
    assert all(any(u.startswith(s) for s in prompt_parts.CHAT_STARTS) for u in users["chat"])
    assert all(any(u.startswith(s) for s in prompt_parts.LONG_STARTS) for u in users["long"])
    forms = (*prompt_parts.CHAT_STARTS, *prompt_parts.TASK_FORMS)
    personas = [f"I'm {p}. " for p in prompt_parts.PERSONAS]
    openings = [*forms, *(p + f for p in personas for f in forms)]
    assert all(any(u.startswith(s) for s in openings) for u in users["open"])
    assert all(any(u.startswith(o) for o in OPENERS) for u in users["steered"])
    assert all(any(c.isdigit() for c in u) for u in users["math"])
    assert {u.split("<|im_end|>")[0] for u in users["seed"]} == set(SEED_PROMPTS[:4])
    turns = [p.count("<|im_start|>user") for p, _, _ in texts["multi"]]
    assert set(turns) == {1}, "12-token first answers never finish, so no conversation goes on"


def test_finished_first_answers_get_a_second_turn(tmp_path: Path) -> None:
    _, args, weights, tok = smollm2()
    gen = EngineGenerator(args, weights, "cpu", "float32", batch_size=16, max_len=400)
    settings = RecipeSettings(max_new_tokens=96, prompt_max_tokens=40, oversample=3.0)
    build_parts(tmp_path, gen, tok, args, cfg=DataConfig(mix={"multi": 1}, part_size=8, settings=settings, seed=2))
    ds = load_dataset(tmp_path)
    seconds = [
        tok.decode(ids[:start].tolist(), skip_special_tokens=False)
        for ids, start in zip(ds.ids, ds.response_start, strict=True)
        if tok.decode(ids[:start].tolist(), skip_special_tokens=False).count("<|im_start|>user") == 2
    ]
    assert seconds, "some first answers finish and the target writes a follow-up"
    for prompt in seconds:
        first_answer = prompt.split("<|im_start|>assistant\n")[1]
        assert first_answer.endswith("<|im_end|>\n") and prompt.endswith("<|im_start|>assistant\n")
