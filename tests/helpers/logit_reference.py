"""A plain-torch reference for logit rules and logprobs: HF transformers' logits, and the rules applied token by
token as OpenAI and vLLM describe them."""

from __future__ import annotations

from typing import Any

import torch


class Reference:
    """HF transformers' Llama over the same weights, and the rules written out token by token."""

    def __init__(self, model: Any) -> None:
        self.model = model  # a transformers causal LM in float32

    @classmethod
    def from_dir(cls, path: Any) -> Reference:
        """The model saved in an HF directory."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())

    @torch.no_grad()
    def logits(self, seq: list[int]) -> torch.Tensor:
        """The next token's logits after `seq`."""
        return self.model(torch.tensor([seq])).logits[0, -1].float()

    @staticmethod
    def apply(logits: torch.Tensor, prompt: list[int], out: list[int], p: dict[str, Any], stops: list[int]) -> Any:
        """The rules as OpenAI and vLLM describe them, one token at a time."""
        lg = logits.clone()
        rp = p.get("repetition_penalty", 1.0)
        for t in set(prompt + out) if rp != 1.0 else ():
            lg[t] = lg[t] / rp if lg[t] > 0 else lg[t] * rp
        for t in set(out):
            lg[t] -= p.get("frequency_penalty", 0.0) * out.count(t) + p.get("presence_penalty", 0.0)
        for t, b in p.get("logit_bias", {}).items():
            lg[t] += b
        if len(out) < p.get("min_tokens", 0):
            lg[stops] = float("-inf")
        return lg

    def greedy(self, prompt: list[int], p: dict[str, Any], stops: list[int] = ()) -> list[int]:  # type: ignore[assignment]
        """Greedy decoding under the rules, `max_tokens` tokens or to the first stop token."""
        out: list[int] = []
        while len(out) < p["max_tokens"]:
            out.append(int(self.apply(self.logits(prompt + out), prompt, out, p, list(stops)).argmax()))
            if out[-1] in stops:
                break
        return out
