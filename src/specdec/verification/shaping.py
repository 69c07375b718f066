"""Temperature, top-k, top-p and min-p applied identically to target and draft logits.

Rejection sampling preserves the *shaped* target distribution, so both sides
must be shaped by the same function before verification.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig


def shape_logits(
    logits: torch.Tensor, sampling: SamplingConfig, temperature: torch.Tensor | None = None
) -> torch.Tensor:
    """Return float32 logits divided by the temperature, with filtered entries (top-k, top-p, min-p) at -inf.

    ``logits`` has the vocabulary as its last dimension; any leading shape is kept.
    ``temperature`` (optional, the leading shape of ``logits``) replaces the
    sampling temperature position by position: a guard's temperature schedule.
    Must not be called in greedy mode (temperature 0), where only the argmax matters.
    """
    logits = logits.float() / (sampling.temperature if temperature is None else temperature[..., None])
    vocab = logits.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0:
        # a token less likely than min_p times the likeliest is dropped (the likeliest always stays)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def to_probs(logits: torch.Tensor, sampling: SamplingConfig, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Shaped probability distribution (float32) over the last dimension (see :func:`shape_logits`)."""
    return shape_logits(logits, sampling, temperature).softmax(dim=-1)
