"""Steered self-written prompts: the real SmolLM2 finishes user turns begun by built-in openers."""

from __future__ import annotations

from speculative.train.data import DataConfig, chat_prompt_ids, magpie_prefix, steered_prompts
from speculative.train.generators import EngineGenerator
from speculative.train.openers import OPENERS

from smol import smollm2


def test_steered_prompts_start_with_openers_and_vary() -> None:
    """Kept prompts begin with their opener, come from several openers, are distinct and chat-wrapped."""
    _, args, weights, tok = smollm2()
    gen = EngineGenerator(args, weights, "cpu", "float32", batch_size=16, max_len=256)
    cfg = DataConfig(steered_prompts=8, magpie_max_tokens=24, magpie_oversample=2.0, seed=3)
    _, stop_extra, _ = magpie_prefix(tok)
    prompts, info = steered_prompts(gen, tok, args, cfg, stop_extra)
    assert info["candidates"] == 16 and info["openers"] == len(OPENERS)
    assert 0 < len(prompts) <= 8 and info["kept"] == len(prompts)
    used = set()
    for p in prompts:
        assert p.source == "steered"
        opener = next(o for o in OPENERS if p.text.startswith(o))
        used.add(opener)
        assert len(p.text) > len(opener)
        assert p.ids == chat_prompt_ids(tok, p.text)
    assert len(used) >= min(3, len(prompts))
    assert len({p.text for p in prompts}) == len(prompts)


def test_steered_prompts_need_a_tokenizer() -> None:
    """Without a tokenizer there is nothing to steer with: no prompts, and the meta says why."""
    _, args, _, _ = smollm2()
    prompts, info = steered_prompts(None, None, args, DataConfig(steered_prompts=4), [])  # type: ignore[arg-type]
    assert prompts == [] and "tokenizer" in info["note"]
