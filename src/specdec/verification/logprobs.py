"""Log-probabilities as reported to users: of the target's distribution after bias and penalties (processors.py) and
the guards' masks, at temperature 1 and before top-k, top-p and min-p, the distribution the step verified against
before sampling's truncation. Greedy and sampled rows report alike; target-only decoding reports the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the ``top`` likeliest tokens' (id, log-probability), likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Row i of ``logits`` [n, V] is the distribution ``tokens[i]`` was chosen from; at most ``top`` alternatives each,
    those of probability above 0."""
    logp = torch.log_softmax(logits.float(), dim=-1).cpu()
    chosen = logp.gather(-1, tokens.cpu()[:, None]).squeeze(-1).tolist()
    if top:  # a token of probability 0 (masked by a grammar or a guard) is no alternative: fewer may be listed
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        alternatives = [
            tuple((t, p) for t, p in zip(row_ids.tolist(), row.tolist(), strict=True) if p != float("-inf"))
            for row_ids, row in zip(ids, values, strict=True)
        ]
    else:
        alternatives = [()] * len(chosen)
    return [TokenLogprob(int(t), float(p), a) for t, p, a in zip(tokens.tolist(), chosen, alternatives, strict=True)]
