"""Streaming detokenization: text deltas from a growing list of token ids."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tokenizers:
    """The engine's tokenizer, which prompts are encoded with in worker threads under `lock`, and a copy of it that
    only the front-end event loop decodes with, so that no stream's text waits on a long prompt's encode."""

    encoder: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    decoder: Any = None

    def __post_init__(self) -> None:
        if self.decoder is None and self.encoder is not None:
            self.decoder = copy.deepcopy(self.encoder)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a short window of recent tokens twice (with and without the new ones) and emits the
    difference, holding text back while it ends in U+FFFD (a character whose bytes are not all in yet).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # used by this thread alone (`Tokenizers.decoder` on the front-end loop)
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context that makes the next decode stable
        self.read_offset = 0  # tokens before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the request (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
