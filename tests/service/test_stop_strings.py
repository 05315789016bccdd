"""Stop strings over text deltas: the streamed text equals the whole text cut at the stop string that
completes first, however the text is split."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.cluster.service.stop_strings import StopStrings

ALPHABET = "ab c\n"


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: text before the stop string whose first occurrence ends first (ties: starts first), and
    whether one occurred."""
    found = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    return (text[: min(found)[1]], True) if found else (text, False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
    splits=st.lists(st.integers(0, 40), max_size=12),
)
def test_streamed_cut_equals_the_whole_cut(text: str, stops: list[str], splits: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(s, len(text)) for s in splits)})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopStrings(stops)
    emitted = []
    for d in deltas:
        emitted.append(matcher.push(d))
        want, _ = cut(text, stops)
        assert want.startswith("".join(emitted)), "emitted text that a stop string later cut"
    if not matcher.hit:
        emitted.append(matcher.flush())
    assert ("".join(emitted), matcher.hit) == cut(text, stops)


def test_text_that_may_begin_a_stop_string_is_held_back() -> None:
    m = StopStrings(["</end>"])
    assert m.push("the answer</e") == "the answer"
    assert m.push("nv> more") == "</env> more"
    assert m.push(" and </end> tail") == " and "
    assert m.hit and m.push("later") == "" and m.flush() == ""


def test_the_stop_string_that_completes_first_wins() -> None:
    """' aa' starts before 'a' but completes after it: the cut falls before 'a', split or not."""
    assert cut(" aa", ["a", " aa"]) == (" ", True)
    m = StopStrings(["a", " aa"])
    assert m.push(" a") == " " and m.hit
