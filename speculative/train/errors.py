"""The one error type train-draft reports to users: a named setting and the reason it is unusable."""

from __future__ import annotations


class TrainSetupError(ValueError):
    """A train-draft input (a flag, the dataset, a checkpoint) cannot be used; names the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
