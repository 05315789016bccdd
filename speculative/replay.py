"""Replayed acceptance, for benchmarks only: verify steps that accept what a recording says instead of
comparing the drafts with the target's tokens.

With random weights a draft is never accepted, so a speculative step at a large shape cannot be timed with
realistic acceptance from the model itself. A recording made on a real model is replayed instead.

Terms:
- path: the accepted drafts of one verify step as node indices in the step's own numbering (node 0 is the
  last accepted token, node j the j-th draft: `SeqPlan.token_ids[j]`). A chain's accepted count c is the
  path 1..c; a tree's path is its accepted branch, root excluded.
- stream: one recorded request's paths, one per verify step.
- forced rows [B, Q] int64: per sequence of a step, column 0 the accepted count, columns 1.. its path
  (0-padded). `verify.forced_chain` and `tree.forced_walk` read them in fixed shapes (safe to capture) in place of the
  greedy comparison: the step accepts the count (clamped to what it drafted) along the path, and emits the
  drafts there followed by the target's own token after the last of them. So every KV move, draft re-run
  and copy of an accepted step runs as in real use; the tokens mean nothing (random weights).
- Request r of a run (in the order requests first reach a verify step) replays stream r mod n, cycling
  through it. A replayed tree path need not be a branch of the tree the step drafted (its shape comes from
  the weights at hand); the KV moves and re-run rows follow the recorded nodes all the same.
- positional streams (adaptive speculation, whose steps change depth): one entry per position of the
  recorded answer instead of per step, the drafts a chain of the recording's K accepts when it starts
  there (teacher-forced on the recorded greedy answer, so it does not depend on which steps ran before).
  A step of depth d at offset o accepts min(run[o], d) and moves the request to o + that + 1; a depth-0
  step moves it by one. A step deeper than the one before it for the same request verifies padding past
  the previous step's drafts, so it accepts at most that step's depth, as a real run would (padding is
  the last token again, which the target rarely accepts).

Only greedy requests are replayed (`ReplayAcceptance.take` refuses others). Nothing in the served
configuration turns this on: the benchmark hands a `ReplayAcceptance` to the engine builder.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mtpserve.speculative.messages import SeqPlan, SeqResult


class ReplayAcceptance:
    """Recorded streams and each request's place in them; gives every verify row its forced row."""

    def __init__(self, streams: Sequence[Sequence[Sequence[int]]], positional: bool = False) -> None:
        self.positional = positional
        self.streams: list[list[list[int]]] = []
        self._width: dict[str, int] = {}  # request -> the width of its last step (positional streams)
        self.handed: dict[str, list[int]] = {}  # accepted counts handed out per request, in step order
        self._index: dict[str, int] = {}  # request -> its stream
        self._cursor: dict[str, int] = {}  # request -> its next step in the stream
        self.load(streams)

    @classmethod
    def from_counts(cls, counts: Sequence[Sequence[int]]) -> ReplayAcceptance:
        """Streams of chains from per-request accepted counts."""
        return cls([[list(range(1, c + 1)) for c in stream] for stream in counts])

    def load(self, streams: Sequence[Sequence[Sequence[int]]]) -> None:
        """Replay these streams from now on (empty ones are skipped), every request starting afresh."""
        kept = [[list(p) for p in s] for s in streams if len(s)]
        if not kept:
            raise ValueError("replayed acceptance needs at least one non-empty stream")
        self.streams = kept
        self.reset()

    def reset(self) -> None:
        """Forget every request: the next one to verify replays stream 0 from its first step."""
        self.handed.clear()
        self._index.clear()
        self._cursor.clear()
        self._width.clear()

    def take(self, seqs: Sequence[SeqPlan], width: int) -> np.ndarray:
        """Forced rows [len(seqs), width] of a step's verify rows, advancing each request in its stream;
        paths longer than width - 1 are cut (the step clamps the count to what it drafted)."""
        out = np.zeros((len(seqs), width), dtype=np.int64)
        for b, s in enumerate(seqs):
            if s.temperature > 0:
                raise ValueError(
                    f"request {s.request_id}: replayed acceptance takes greedy requests only "
                    f"(temperature {s.temperature})"
                )
            rid = s.request_id
            index = self._index.setdefault(rid, len(self._index))
            stream = self.streams[index % len(self.streams)]
            step = self._cursor.get(rid, 0)
            most = self._most(rid, width)
            path = stream[step % len(stream)][:most]
            self._cursor[rid] = step + (1 + len(path) if self.positional else 1)
            out[b, 0] = len(path)
            out[b, 1 : 1 + len(path)] = path
            if most > 0:  # a step without real drafts verifies nothing (and is not counted)
                self.handed.setdefault(rid, []).append(len(path))
        return out

    def _most(self, rid: str, width: int) -> int:
        """The most drafts a step of `width` verify rows may accept for request `rid`."""
        if not self.positional:
            return width - 1
        before = self._width.get(rid, width)
        self._width[rid] = width
        return min(width, before) - 1


def accepted_path(seq: SeqPlan, result: SeqResult) -> list[int]:
    """The accepted node indices of a verify step from its plan and result: 1..n for a chain; for a tree,
    the branch whose drafts are the emitted tokens (siblings carry distinct tokens, so it is unique)."""
    n = result.num_accepted
    if seq.draft_parents is None:
        return list(range(1, n + 1))
    parents = [-1, *seq.draft_parents]
    node, path = 0, []
    for token in result.new_token_ids[:n]:
        child = next(
            (c for c in range(1, len(parents)) if parents[c] == node and seq.token_ids[c] == token),
            None,
        )
        if child is None:
            raise ValueError(f"request {seq.request_id}: emitted token {token} continues no draft of node {node}")
        path.append(child)
        node = child
    return path
