"""The target's logits before temperature: logit_bias, then the repetition, frequency and presence penalties.

A step's logits have one column per verified position: column 0 follows the row's context (its prompt and accepted
output), column j + 1 follows the context and the drafts on the path to node j (a chain's drafts[:j + 1]). Each column
is processed from exactly that context, so verification judges each draft against the distribution target-only
decoding would have had there. The processing is elementwise in (logit, bias, count, seen), so a column gets the same
bits whether it is decoded target-only or verified in a speculative step.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig
from specdec.errors import ConfigError


def check_vocabulary(sampling: SamplingConfig, vocab_size: int) -> None:
    """Raise ConfigError where ``logit_bias`` names a token the vocabulary lacks."""
    outside = [token for token, _ in sampling.logit_bias if token >= vocab_size]
    if outside:
        raise ConfigError(f"logit_bias names token {outside[0]}, outside the vocabulary of {vocab_size}: drop it")


def process(
    logits: torch.Tensor,
    context: torch.Tensor,
    prompt_length: int,
    drafts: torch.Tensor,
    links: torch.Tensor,
    sampling: SamplingConfig,
) -> None:
    """Apply ``sampling``'s bias and penalties to ``logits`` [n + 1, V] in place.

    ``context``: the row's tokens [T] (prompt then output, on the host); ``drafts`` [n] and ``links`` [n] (each node's
    parent, -1 for a root; parents come before their children) the step's drafts.
    """
    if not sampling.processed:
        return
    vocab, device = logits.shape[-1], logits.device
    counts = torch.bincount(context[prompt_length:], minlength=vocab)[:vocab].to(device, torch.float32)
    seen = (torch.bincount(context, minlength=vocab)[:vocab] > 0).to(device)
    bias = torch.zeros(vocab, dtype=logits.dtype, device=device)
    if sampling.logit_bias:
        ids, values = zip(*sampling.logit_bias, strict=True)
        bias[list(ids)] = torch.tensor(values, dtype=logits.dtype, device=device)
    n = len(drafts)
    if n == 0:
        logits.copy_(_processed(logits, bias, counts, seen, sampling))
        return
    # The drafted tokens' entries differ between columns: taken raw now, processed per column below.
    touched, index = torch.unique(drafts, return_inverse=True)
    columns = touched.to(device)
    raw = logits[:, columns].clone()
    logits.copy_(_processed(logits, bias, counts, seen, sampling))
    extra = torch.zeros(n + 1, len(touched), dtype=torch.float32)  # column j + 1: the path's tokens, counted
    for j, parent in enumerate(links.tolist()):
        extra[j + 1] = extra[parent + 1]
        extra[j + 1, index[j]] += 1
    extra = extra.to(device)
    logits[:, columns] = _processed(raw, bias[columns], counts[columns] + extra, seen[columns] | (extra > 0), sampling)


def _processed(
    logits: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, sampling: SamplingConfig
) -> torch.Tensor:
    """The processed logits, elementwise: bias added, repetition penalty on seen tokens, then frequency and presence
    penalties by the output's counts."""
    out = logits + bias
    r = sampling.repetition_penalty
    if r != 1:
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if sampling.frequency_penalty or sampling.presence_penalty:
        out = out - (counts * sampling.frequency_penalty + (counts > 0).float() * sampling.presence_penalty)
    return out
