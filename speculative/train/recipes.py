"""Recipes for the draft dataset: each builds one part (a fixed number of samples) of one kind of data.

A recipe draws its prompt beginnings from a seeded RNG, lets the target finish user turns where it needs
self-written prompts (Magpie-style), and has the target answer. Kinds: chat requests over many subjects
(`chat`), bare self-written prompts (`magpie`), opener-steered prompts (`steered`), arithmetic word
problems (`math`), raw Python completion without a chat template (`code`), long multi-paragraph
answers (`long`), second turns of conversations (`multi`) and the built-in seed list (`seed`).
Every recipe is a pure function of (seed, part) given the same generator outputs.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mtpserve.modeling.model import LlamaArgs
from mtpserve.speculative.train import prompt_parts as pp
from mtpserve.speculative.train.generators import Generator, GenSettings
from mtpserve.speculative.train.openers import OPENERS
from mtpserve.speculative.train.seed_prompts import SEED_PROMPTS


@dataclass
class Sample:
    """One training sequence: prompt + response token ids and where the response starts."""

    ids: list[int]
    response_start: int
    greedy: bool
    source: str
    finish: str


@dataclass
class RecipeSettings:
    """Lengths, temperatures and filters shared by the recipes."""

    max_new_tokens: int = 384  # response cap
    long_max_new_tokens: int = 768  # response cap of the `long` recipe
    code_max_new_tokens: int = 256  # continuation cap of the `code` recipe
    prompt_max_tokens: int = 96  # cap while the target writes a user turn
    prompt_temperature: float = 0.9
    oversample: float = 2.0  # user-turn candidates per sample kept
    min_prompt_chars: int = 12
    sampled_fraction: float = 0.2  # responses sampled instead of greedy
    response_temperature: float = 0.7
    max_prompt_tokens: int = 1024
    code_root: str | None = None  # Python sources for `code` prompts (default: this interpreter's stdlib)


@dataclass
class RecipeContext:
    """What recipes build with: the generator, the tokenizer (None for token-level targets) and settings."""

    generator: Generator
    tokenizer: Any
    args: LlamaArgs
    settings: RecipeSettings
    stop_ids: tuple[int, ...]
    turn_end: list[int]  # the token that closes a chat turn (e.g. <|im_end|>)
    _header: tuple[list[int], str] | None = field(default=None, repr=False)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation in the chat template, ready for the assistant's next turn."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def user_header(self, history: list[dict[str, str]]) -> list[int]:
        """Ids of `history` rendered in the template, followed by the opening of a new user turn."""
        mark = "\u2063U\u2063"
        text = self.tokenizer.apply_chat_template([*history, {"role": "user", "content": mark}], tokenize=False)
        return [int(t) for t in self.tokenizer.encode(text.split(mark, 1)[0], add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Plain token ids of `text` (no special tokens)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def write_user_turns(self, prefixes: list[list[int]], starts: list[str], seed: int) -> list[str | None]:
        """The target finishes each user turn (rendered history + opener `starts[i]`); the text, or None when it
        rambled past the cap, is too short, or repeats an earlier one."""
        s = self.settings
        settings = GenSettings(s.prompt_max_tokens, s.prompt_temperature, 1.0, seed, stop_ids=self.stop_ids)
        outs = self.generator.generate(
            [p + self.encode(st) if st else p for p, st in zip(prefixes, starts, strict=True)], settings, "user turns"
        )
        texts: list[str | None] = []
        seen: set[str] = set()
        for start, res in zip(starts, outs, strict=True):
            if res.finish_reason != "stop":
                texts.append(None)
                continue
            body = [t for t in res.token_ids if t not in self.stop_ids]
            text = (start + self.tokenizer.decode(body, skip_special_tokens=True)).strip()
            key = " ".join(text.lower().split())
            ok = len(text) >= s.min_prompt_chars and len(text.split()) >= 3 and key not in seen
            seen.add(key)
            texts.append(text if ok else None)
        return texts

    def respond(
        self, prompts: list[list[int]], source: str, seed: int, max_new_tokens: int | None = None
    ) -> list[Sample]:
        """The target answers every prompt: greedily, or sampled (temperature only) for a seeded share."""
        return [s for s in self.answers(prompts, source, seed, max_new_tokens) if s is not None]

    def answers(
        self, prompts: list[list[int]], source: str, seed: int, max_new_tokens: int | None = None
    ) -> list[Sample | None]:
        """`respond`, aligned with `prompts` (None where a prompt is too long or the answer too short)."""
        s = self.settings
        rng = random.Random(seed)
        sampled = [rng.random() < s.sampled_fraction for _ in prompts]
        out: list[Sample | None] = [None] * len(prompts)
        cap = max_new_tokens or s.max_new_tokens
        for mode in (False, True):
            idx = [i for i, m in enumerate(sampled) if m == mode and len(prompts[i]) <= s.max_prompt_tokens]
            if not idx:
                continue
            temp = s.response_temperature if mode else 0.0
            settings = GenSettings(cap, temp, 1.0, seed + (104729 if mode else 0), stop_ids=self.stop_ids)
            res = self.generator.generate([prompts[i] for i in idx], settings, f"{source} answers")
            for i, r in zip(idx, res, strict=True):
                if len(r.token_ids) >= 2:
                    out[i] = Sample(prompts[i] + r.token_ids, len(prompts[i]), not mode, source, finish=r.finish_reason)
        return out


class Recipe(Protocol):
    """Builds part `part` of one kind of data: about `count` samples."""

    name: str
    needs_tokenizer: bool

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """Samples of this part (a pure function of seed and part, given the generator's outputs)."""
        ...


def _rng(seed: int, name: str, part: int) -> random.Random:
    return random.Random(f"{seed}:{name}:{part}")


def _int_seed(rng: random.Random) -> int:
    return rng.randrange(1 << 30)


@dataclass
class SelfWrittenRecipe:
    """Chat data whose user turns the target writes itself after an opener drawn by `opener(rng)`."""

    name: str
    opener: Callable[[random.Random], str]
    long_answers: bool = False
    needs_tokenizer: bool = True

    def prompts(self, ctx: RecipeContext, rng: random.Random, count: int) -> list[str]:
        """User messages written by the target (at most `count`)."""
        n = max(count, int(count * ctx.settings.oversample))
        header = ctx.user_header([])
        starts = [self.opener(rng) for _ in range(n)]
        texts = ctx.write_user_turns([list(header)] * n, starts, _int_seed(rng))
        return [t for t in texts if t is not None][:count]

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """Write the user turns, then answer them."""
        rng = _rng(seed, self.name, part)
        texts = self.prompts(ctx, rng, count)
        ids = [ctx.chat_ids([{"role": "user", "content": t}]) for t in texts]
        cap = ctx.settings.long_max_new_tokens if self.long_answers else None
        return ctx.respond(ids, self.name, _int_seed(rng), cap)


@dataclass
class OpenTopicRecipe:
    """Chat data over topics from anywhere in the vocabulary: the opener pairs a request shape (CHAT_STARTS or
    TASK_FORMS), sometimes after a persona, with one or two whole-word tokens of the tokenizer, so the
    subjects are not limited to a list; the target writes the rest of the user turn and answers it."""

    name: str = "open"
    needs_tokenizer: bool = True

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """Write the user turns, then answer them."""
        rng = _rng(seed, self.name, part)
        words = vocabulary_words(ctx.tokenizer)
        opener = SelfWrittenRecipe(self.name, lambda r: open_opener(r, words))
        texts = opener.prompts(ctx, rng, count)
        ids = [ctx.chat_ids([{"role": "user", "content": t}]) for t in texts]
        return ctx.respond(ids, self.name, _int_seed(rng))


def vocabulary_words(tokenizer: Any) -> list[str]:
    """Lower-case alphabetic whole-word tokens (4-12 letters) of a byte-level BPE vocabulary, sorted."""
    words = {t[1:] for t in tokenizer.get_vocab() if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower()}
    return sorted(w for w in words if 4 <= len(w) <= 12)


def open_opener(rng: random.Random, words: list[str]) -> str:
    """A request shape and one or two vocabulary words, a quarter of the time after a persona."""
    start = rng.choice(pp.CHAT_STARTS + pp.TASK_FORMS)
    topic = rng.choice(words) if rng.random() < 0.6 else f"{rng.choice(words)} and {rng.choice(words)}"
    if rng.random() < 0.25:
        return f"I'm {rng.choice(pp.PERSONAS)}. {start} {topic}"
    return f"{start} {topic}"


def _chat_opener(rng: random.Random) -> str:
    return f"{rng.choice(pp.CHAT_STARTS)} {rng.choice(pp.SUBJECTS)}"


def _long_opener(rng: random.Random) -> str:
    return f"{rng.choice(pp.LONG_STARTS)} {rng.choice(pp.SUBJECTS)}"


def _steered_opener(rng: random.Random) -> str:
    return rng.choice(OPENERS) + " "


def _magpie_opener(rng: random.Random) -> str:
    return ""


def math_numbers(rng: random.Random) -> dict[str, Any]:
    """Names, items and numbers for one word problem."""
    item, items = rng.choice(pp.ITEMS)
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 20)
    return {
        "name": rng.choice(pp.NAMES),
        "item": item,
        "items": items,
        "a": a,
        "b": b,
        "c": c,
        "n": rng.randint(3, 12) * rng.choice((4, 5, 6, 10)),
        "p": rng.choice((2, 3, 4, 5, 6, 8, 12, 15, 20)),
        "m": rng.choice((20, 50, 100, 200, 500)),
        "pct": rng.choice((10, 15, 20, 25, 30, 40)),
        "h": rng.randint(1, 11),
    }


@dataclass
class MathRecipe:
    """Arithmetic word problems: half finished by the target from a numeric opener, half complete templates."""

    name: str = "math"
    needs_tokenizer: bool = True

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """Write half of the problems with the target, fill the rest from templates, then answer all."""
        rng = _rng(seed, self.name, part)
        half = count // 2
        writer = SelfWrittenRecipe(self.name, lambda r: r.choice(pp.MATH_STARTS).format(**math_numbers(r)))
        texts = writer.prompts(ctx, rng, half)
        while len(texts) < count:
            texts.append(rng.choice(pp.MATH_COMPLETE).format(**math_numbers(rng)) + rng.choice(pp.MATH_ASKS))
        rng.shuffle(texts)
        ids = [ctx.chat_ids([{"role": "user", "content": t}]) for t in texts]
        return ctx.respond(ids, self.name, _int_seed(rng))


@dataclass
class MultiTurnRecipe:
    """Two-turn conversations: a chat turn and its answer, a follow-up the target writes, and its answer.
    Both the first turn and the whole conversation become samples."""

    name: str = "multi"
    needs_tokenizer: bool = True

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """First turns, follow-ups written by the target, second answers."""
        rng = _rng(seed, self.name, part)
        texts = SelfWrittenRecipe(self.name, _chat_opener).prompts(ctx, rng, max(1, count // 2))
        prompts = [ctx.chat_ids([{"role": "user", "content": t}]) for t in texts]
        first = ctx.answers(prompts, self.name, _int_seed(rng))
        histories = []
        for text, s in zip(texts, first, strict=True):
            if s is not None and s.finish == "stop":
                answer = ctx.tokenizer.decode(s.ids[s.response_start :], skip_special_tokens=True).strip()
                histories.append([{"role": "user", "content": text}, {"role": "assistant", "content": answer}])
        follow = ctx.write_user_turns([ctx.user_header(h) for h in histories], [""] * len(histories), _int_seed(rng))
        convs = [[*h, {"role": "user", "content": f}] for h, f in zip(histories, follow, strict=True) if f]
        second = ctx.respond([ctx.chat_ids(c) for c in convs], self.name, _int_seed(rng))
        return [s for s in first if s is not None] + second


@dataclass
class SeedRecipe:
    """The built-in hand-written prompts (one part; usually held apart for dev)."""

    name: str = "seed"
    needs_tokenizer: bool = True

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """Answer the seed prompts of this part."""
        texts = list(SEED_PROMPTS[part * count : (part + 1) * count])
        ids = [ctx.chat_ids([{"role": "user", "content": t}]) for t in texts]
        return ctx.respond(ids, self.name, seed + part)


@functools.lru_cache(maxsize=4)
def python_functions(root: str | None) -> tuple[tuple[str, str], ...]:
    """(file head, function source) of every documented function under `root` (default: this interpreter's
    standard library, without its tests and site-packages), in file order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for path in sorted(base.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        out += documented_functions(path)
    return tuple(out)


@dataclass
class CodeRecipe:
    """Raw Python completion, no chat template: function heads with their docstrings, or a function cut at a
    line of its body, taken from the Python sources under `code_root` (default: the standard library)."""

    name: str = "code"
    needs_tokenizer: bool = True

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """Cut `count` random functions into completion prompts and let the target continue them."""
        rng = _rng(seed, self.name, part)
        funcs = python_functions(ctx.settings.code_root)
        if not funcs:
            return []
        prompts = [ctx.encode(completion_prompt(*rng.choice(funcs), rng)) for _ in range(count)]
        prompts = [p[-ctx.settings.max_prompt_tokens // 2 :] for p in prompts if p]
        return ctx.respond(prompts, self.name, _int_seed(rng), ctx.settings.code_max_new_tokens)


def documented_functions(path: Path) -> list[tuple[str, str]]:
    """(file head: up to 6 import lines, source) of each function in `path` with a docstring."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines = text.splitlines()
    imports = [ln for ln in lines if ln.startswith(("import ", "from "))][:6]
    head = "\n".join(imports) + ("\n\n\n" if imports else "")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node):
            src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if 3 <= src.count("\n") <= 80:
                out.append((head, src))
    return out


def completion_prompt(head: str, func: str, rng: random.Random) -> str:
    """A stub (head + def + docstring, ending at the body's indent) or the function cut after a body line."""
    lines = func.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    body_at = next((i for i, ln in enumerate(lines[1:], 1) if ln.strip().endswith(('"""', "'''"))), 1)
    prefix = "\n".join(ln[indent:] for ln in lines)
    cut_lines = prefix.splitlines()
    if rng.random() < 0.5 or body_at + 1 >= len(cut_lines):
        stub = "\n".join(cut_lines[: body_at + 1])
        pad = cut_lines[body_at][: len(cut_lines[body_at]) - len(cut_lines[body_at].lstrip())]
        return head + stub + "\n" + pad
    cut = rng.randint(body_at + 1, len(cut_lines) - 1)  # never the whole function
    return head + "\n".join(cut_lines[:cut]) + "\n"


@dataclass
class RandomRecipe:
    """Random token-id prompts answered by the target, for targets without a tokenizer (tests, dummy shapes)."""

    name: str = "random"
    needs_tokenizer: bool = False

    def build(self, ctx: RecipeContext, part: int, count: int, seed: int) -> list[Sample]:
        """`count` prompts of 6-20 random ids, answered."""
        rng = _rng(seed, self.name, part)
        lo = min(3, ctx.args.vocab_size - 1)
        prompts = [[rng.randrange(lo, ctx.args.vocab_size) for _ in range(rng.randint(6, 20))] for _ in range(count)]
        return ctx.respond(prompts, self.name, _int_seed(rng))


RECIPES: dict[str, Callable[[], Recipe]] = {
    "chat": lambda: SelfWrittenRecipe("chat", _chat_opener),
    "magpie": lambda: SelfWrittenRecipe("magpie", _magpie_opener),
    "steered": lambda: SelfWrittenRecipe("steered", _steered_opener),
    "long": lambda: SelfWrittenRecipe("long", _long_opener, long_answers=True),
    "open": OpenTopicRecipe,
    "math": MathRecipe,
    "multi": MultiTurnRecipe,
    "code": CodeRecipe,
    "seed": SeedRecipe,
    "random": RandomRecipe,
}


def make_recipe(name: str) -> Recipe:
    """The recipe called `name`; raises KeyError listing the known ones."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe '{name}'; known: {', '.join(RECIPES)}")
    return RECIPES[name]()
