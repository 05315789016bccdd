"""Logprobs in the OpenAI response shapes: chat's `logprobs.content` list and the completions API's parallel lists."""

from __future__ import annotations

from typing import Any

from mtpserve.speculative.token_logprobs import TokenLogprobs


class TokenTexts:
    """Each token's text as logprobs show it: the token decoded alone (kept once decoded), or `token_id:N` for a
    model without a tokenizer. Used from the event loop's thread only, as the decoder is."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        """The text of one token."""
        text = self._texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.decoder is None else self.decoder.decode([token_id])
            self._texts[token_id] = text
        return text


def chat_logprobs(lp: TokenLogprobs, ids: list[int], texts: TokenTexts) -> dict[str, Any]:
    """A chat choice's `logprobs`: one entry per token with its text, bytes, logprob and top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for tok, value, top_ids, top_values in zip(ids, lp.token_logprobs, lp.top_token_ids, lp.top_logprobs, strict=True):
        item = entry(tok, value)
        item["top_logprobs"] = [entry(t, v) for t, v in zip(top_ids, top_values, strict=True)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(lp: TokenLogprobs, ids: list[int], texts: TokenTexts, offset: int) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, their logprobs, each one's alternatives as {text: logprob}
    (None when none were asked for) and text offsets counted from `offset` (the text before this part)."""
    tokens = [texts(t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [
        {texts(t): v for t, v in zip(top_ids, values, strict=True)} if top_ids else None
        for top_ids, values in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
    ]
    return {"tokens": tokens, "token_logprobs": lp.token_logprobs, "top_logprobs": top, "text_offset": offsets}
