"""Draft methods: each proposes K tokens per request from a step's DraftInputs."""

from __future__ import annotations

from abc import ABC, abstractmethod

from mtpserve.speculative.messages import DraftInputs, DraftOutputs


class DraftMethod(ABC):
    """A way of proposing draft tokens; one small class per method."""

    @abstractmethod
    def propose(self, inputs: DraftInputs) -> DraftOutputs:
        """Consume this step's rows (updating any draft KV) and propose drafts where asked."""

    def release(self, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Forget per-request state of finished requests."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the method holds; one in this process holds nothing beyond its tensors."""
