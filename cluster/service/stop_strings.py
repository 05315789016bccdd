"""Stop strings on a stream of text deltas: cut at the first one to complete, never emitting text that may
begin one."""

from __future__ import annotations

MAX_STOP_STRINGS = 4


def stop_strings_problem(stops: list[str]) -> str | None:
    """Why a request's stop strings cannot be served (too many, or an empty one); None when they can."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    if any(s == "" for s in stops):
        return "stop strings must not be empty"
    return None


class StopStrings:
    """Cuts a text stream at the stop string that completes first (ties: the one that starts first); the
    stop string itself is dropped unless `keep`. Generation checks stop strings as text arrives, so the first one to
    complete ends it, and the cut does not depend on how the text is split into deltas.

    Text that could be the start of a stop string is held back until the next delta settles it, so what
    `push` returns never has to be taken back.
    """

    def __init__(self, stops: list[str], keep: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.keep = keep  # the stop string itself is returned (vLLM's include_stop_str_in_output)
        self.held = ""
        self.hit = False

    def push(self, delta: str) -> str:
        """Text that may be emitted now; once a stop string is found (`hit`), the text before it, then nothing."""
        if self.hit:
            return ""
        text = self.held + delta
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.hit, self.held = True, ""
            end, start = min(found)
            return text[: end if self.keep else start]
        keep = self._open_prefix(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def rewind(self, held: str) -> None:
        """Back to before a stop string was found, with `held` (a saved `held`) held back."""
        self.held, self.hit = held, False

    def flush(self) -> str:
        """The text held back when the stream ends without a stop string."""
        out, self.held = self.held, ""
        return out

    def _open_prefix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(len(text), longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
