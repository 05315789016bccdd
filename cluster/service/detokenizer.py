"""Streaming detokenization: text deltas from a growing list of token ids."""

from __future__ import annotations

import copy
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mtpserve.cluster.engine.errors import InvalidRequestError

ENCODE_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class Tokenizers:
    """The engine's tokenizer; `submit` encodes prompts on a few threads, each with its own copy made up front (HF
    tokenizers refuse concurrent use of one instance), so that no prompt waits on another's encode; `decoder` is the
    copy the front-end event loop decodes streams with, so that no stream's text waits on a prompt."""

    encoder: Any
    decoder: Any = None
    threads: int = ENCODE_THREADS

    def __post_init__(self) -> None:
        if self.decoder is None and self.encoder is not None:
            self.decoder = copy.deepcopy(self.encoder)
        self._max_token_bytes: int | None = None
        self._local = threading.local()
        copies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(self.threads if self.encoder is not None else 0):
            copies.put(copy.deepcopy(self.encoder))
        self._pool = ThreadPoolExecutor(
            self.threads, "mtpserve-encode", initializer=lambda: setattr(self._local, "tok", copies.get())
        )

    def submit(self, fn: Callable[..., list[int]], *args: Any) -> Future[list[int]]:
        """`fn(tokenizer, *args)` on an encoding thread, with that thread's copy of the tokenizer."""
        return self._pool.submit(lambda: fn(self._local.tok, *args))

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token of the vocabulary (a text of n bytes has at least n / this many tokens)."""
        if self._max_token_bytes is None:
            vocab = self.encoder.get_vocab() if self.encoder is not None else {}
            # byte-level BPE spells a byte as one character: the string length bounds its bytes from above
            self._max_token_bytes = max((len(tok.encode("utf-8")) for tok in vocab), default=1)
        return self._max_token_bytes

    def check_length(self, text_bytes: int, max_model_len: int, field: str) -> None:
        """InvalidRequestError naming `field` when a text of `text_bytes` bytes must hold at least max_model_len
        tokens, without tokenizing it (which takes seconds for megabytes, under the shared lock)."""
        if text_bytes > max_model_len * self.max_token_bytes:
            raise InvalidRequestError(
                field, f"has {text_bytes} bytes: more tokens than the model's maximum length {max_model_len}"
            )


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

    def mark(self) -> tuple[int, int, int]:
        """The state to `rewind` to."""
        return len(self.ids), self.prefix_offset, self.read_offset

    def rewind(self, mark: tuple[int, int, int]) -> None:
        """Forget what was pushed since `mark`."""
        n, self.prefix_offset, self.read_offset = mark
        del self.ids[n:]

    def flush(self) -> str:
        """Text still held back at the end of the request (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
