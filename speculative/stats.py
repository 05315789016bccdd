"""Speculation counters: drafted, accepted, acceptance rate and length, per-position acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    """Speculation counters for one request or for the whole engine."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Add one verify step that checked `num_drafted` drafts and accepted `num_accepted`."""
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.verify_steps += 1
        grow = num_drafted - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position += [0] * grow
            self.drafted_per_position += [0] * grow
        for k in range(num_drafted):
            self.drafted_per_position[k] += 1
            self.accepted_per_position[k] += int(k < num_accepted)

    def merge(self, other: SpecStats) -> None:
        """Accumulate another request's counters."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verify_steps += other.verify_steps
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))

        def added(mine: list[int], theirs: list[int]) -> list[int]:
            return [(mine[i] if i < len(mine) else 0) + (theirs[i] if i < len(theirs) else 0) for i in range(n)]

        self.accepted_per_position = added(self.accepted_per_position, other.accepted_per_position)
        self.drafted_per_position = added(self.drafted_per_position, other.drafted_per_position)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / verify steps."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 0.0

    def per_position_rates(self) -> list[float]:
        """Fraction of verify steps whose k-th draft was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        """The stats object of the `--json` contract."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_steps": self.verify_steps,
            "acceptance_rate": round(self.acceptance_rate, 6),
            "acceptance_length": round(self.acceptance_length, 6),
            "accepted_per_position": [round(r, 6) for r in self.per_position_rates()],
        }
