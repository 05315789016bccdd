"""A request's logit rules (penalties, logit bias, min_tokens, min_p) and the logprobs it asks for, applied
to the target's verify rows so that speculation stays exact.

A verify row predicts one token; under speculation that token follows drafts the target has not accepted
yet, so each row takes its rules with the history it would have if they were: the request's output so far
plus the drafts on the row's branch. Request with output [5, 7], last token 7, drafts d1=9, d2=5 (a chain):
row 0 predicts the token after 7 with history [5, 7]; row 1 the token after 9 with [5, 7, 9]; row 2 the
token after d2 with [5, 7, 9, 5], where 5 counts twice for the frequency penalty. In a tree a node's branch
is the drafts from the root down to it. Greedy verification then takes each row's processed argmax, and
rejection sampling its processed distribution, so the emitted tokens are those one-token-a-step decoding
with the same rules gives.

Order within a row: repetition penalty (prompt and output tokens), frequency and presence penalties (output
tokens), logit bias, the stop tokens masked while the output is shorter than min_tokens, then the tokens a
grammar does not allow there (structured outputs; the engine's matcher fills the masks per row). Temperature,
top-k, top-p and then min_p shape the distribution of a sampled row (`min_p_filter`). Logprobs are those of
the model's raw logits (before every rule and temperature), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtpserve.speculative.token_logprobs import TokenLogprobs


@dataclass
class LogitsProcessing:
    """One request's rules for its rows in a step (SeqPlan.processing); None there means no rule and no
    logprobs, which lets the step run on the captured paths."""

    output_token_ids: list[int] = field(default_factory=list)  # generated so far: the history of row 0
    prompt_token_ids: list[int] = field(default_factory=list)  # sent only with a repetition penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # masked while the output is below min_tokens
    min_p: float = 0.0
    logprobs: int = -1  # -1: none; 0: each emitted token's own; n: also the n most likely tokens
    allowed: torch.Tensor | None = None  # [rows, words] int32 bitmasks of the tokens a grammar allows per row

    @property
    def changes_logits(self) -> bool:
        """Whether any rule alters the logits (logprobs alone do not)."""
        return bool(
            self.allowed is not None
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or (self.min_tokens > len(self.output_token_ids) and self.stop_token_ids)
        )


def row_branches(token_ids: list[int], parents: list[int] | None, rows: int) -> list[list[int]]:
    """The drafts before each of a sequence's first `rows` verify rows: row 0 follows none, row j of a chain
    follows token_ids[1..j], and node j of a tree (parents[j-1] the node it continues) its branch from the
    root. token_ids[0] is the last accepted token and already part of the output."""
    branches: list[list[int]] = [[]]
    for j in range(1, rows):
        parent = j - 1 if parents is None else parents[j - 1]
        branches.append([*branches[parent], token_ids[j]])
    return branches


def process_rows(logits: torch.Tensor, rules: LogitsProcessing, branches: list[list[int]]) -> torch.Tensor:
    """The rows' logits [R, V] after `rules`, row r taking the output so far plus branches[r] as its
    history (a new tensor; `logits` is left as it is)."""
    v = logits.shape[1]
    dev = logits.device
    out = logits.clone()
    if rules.repetition_penalty != 1.0 or rules.presence_penalty or rules.frequency_penalty:
        counts = _counts(rules.output_token_ids, branches, v, dev)
        if rules.repetition_penalty != 1.0:
            seen = counts > 0
            if rules.prompt_token_ids:
                seen[:, torch.tensor(rules.prompt_token_ids, device=dev)] = True
            rp = rules.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
        out -= rules.frequency_penalty * counts + rules.presence_penalty * (counts > 0).to(out.dtype)
    if rules.logit_bias:
        ids = torch.tensor(list(rules.logit_bias), device=dev)
        out[:, ids] += torch.tensor(list(rules.logit_bias.values()), dtype=out.dtype, device=dev)
    if rules.stop_token_ids and rules.min_tokens > len(rules.output_token_ids):
        short = [i for i, b in enumerate(branches) if len(rules.output_token_ids) + len(b) < rules.min_tokens]
        stops = torch.tensor(rules.stop_token_ids, device=dev)
        out[torch.tensor(short, device=dev)[:, None], stops[None, :]] = float("-inf")
    if rules.allowed is not None:
        out = out.masked_fill(~allowed_tokens(rules.allowed.to(dev), v), float("-inf"))
    return out


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: which tokens each row's bitmask allows (bit t % 32 of int32 word t // 32)."""
    bits = torch.arange(32, dtype=torch.int32, device=masks.device)
    unpacked = (masks[:, :, None] >> bits) & 1
    return unpacked.reshape(masks.shape[0], -1)[:, :vocab_size].bool()


def _counts(output: list[int], branches: list[list[int]], v: int, dev: torch.device) -> torch.Tensor:
    """[R, V] float: how often each token occurs in the output plus each row's branch."""
    base = torch.bincount(torch.tensor(output, dtype=torch.long, device=dev), minlength=v)[:v].float()
    counts = base.expand(len(branches), v).clone()
    for row, branch in enumerate(branches):
        if branch:
            counts[row].index_add_(0, torch.tensor(branch, device=dev), torch.ones(len(branch), device=dev))
    return counts


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs [N, V] without the tokens below min_p [N] times their row's most likely token's probability,
    renormalized (rows with min_p 0 unchanged)."""
    if not bool((min_p > 0).any()):
        return probs
    keep = probs >= min_p[:, None] * probs.amax(-1, keepdim=True)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def emitted_logprobs(raw_logits: torch.Tensor, tokens: list[int], top: int) -> TokenLogprobs:
    """Logprobs of `tokens`, token i read from raw_logits row i [len(tokens), V], with the `top` most likely
    tokens of each row."""
    lp = torch.log_softmax(raw_logits[: len(tokens)].float(), dim=-1)
    picked = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(-1).tolist()
    if top <= 0:
        return TokenLogprobs(picked, [[] for _ in tokens], [[] for _ in tokens])
    values, ids = lp.topk(top, dim=-1)
    return TokenLogprobs(picked, ids.tolist(), values.tolist())
