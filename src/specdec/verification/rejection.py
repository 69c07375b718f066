"""Exact speculative verification (Leviathan et al. 2023; Chen et al. 2023), vectorised over the batch.

Greedy: a draft token is accepted while it equals the target's argmax.
Sampling: draft token y, drawn from q, is accepted with probability
min(1, p(y) / q(y)); at the first rejection the next token is drawn from
norm(max(0, p - q)); if every draft token passes, a bonus token is drawn from
p at the next position. The produced tokens then follow p exactly.

A deterministic draft (q one-hot on y) is the case min(1, p(y)) = p(y): the target draws each position from p
itself, with the uniform of that position, and keeps the draft token while it is the target's draw. The law is the
same, and so are the tokens: those the target alone would draw with the same uniforms, whatever was drafted.

The uniforms come from the caller (:class:`Uniforms`; the engine keys them by position, seeds.py) or from ``rng``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec.config import SamplingConfig
from specdec.verification.sampling import draw, greedy
from specdec.verification.shaping import to_probs


@dataclass(frozen=True)
class Verdict:
    """What verification decided for each row of a batch, chains and trees alike.

    ``accepted`` [B]: the draft nodes accepted; ``next_token`` [B]: the target's own token after them (recovered or
    bonus, see the package docstring). ``paths``: for trees, each row's accepted nodes from the root; None for chains,
    whose accepted nodes are the first ``accepted`` ones.
    """

    accepted: torch.Tensor
    next_token: torch.Tensor
    paths: list[list[int]] | None = None

    def on_host(self) -> torch.Tensor:
        """[2, B] on the host, accepted counts then next tokens: one device-to-host transfer for the caller's
        bookkeeping."""
        return torch.stack([self.accepted, self.next_token]).cpu()

    def per_row(self) -> list[tuple[list[int], int]]:
        """Each row's accepted nodes and the next token, on the host."""
        accepted, next_tokens = self.on_host().tolist()
        paths = self.paths if self.paths is not None else [list(range(n)) for n in accepted]
        return list(zip(paths, next_tokens, strict=True))


class Uniforms(NamedTuple):
    """The uniforms in [0, 1) that decide verdicts, on the logits' device (float64; float32 on MPS).

    Chains [B rows, k drafts]: ``sample`` [B, k + 1], the target's own draw at each position (from p, or from the
    residual after a rejection); ``accept`` [B, k], the acceptance test of each drawn draft token. A tree of n nodes:
    ``sample`` [n + 1], one per level from the root's children down; ``accept`` [n], one per node.
    """

    sample: torch.Tensor
    accept: torch.Tensor

    @staticmethod
    def drawn(
        sample: tuple[int, ...], accept: tuple[int, ...], device: torch.device, rng: torch.Generator | None
    ) -> Uniforms:
        """Uniforms of these shapes drawn with ``rng`` (torch's global generator when None)."""
        dtype = torch.float32 if device.type == "mps" else torch.float64
        return Uniforms(
            torch.rand(sample, generator=rng, device=device, dtype=dtype),
            torch.rand(accept, generator=rng, device=device, dtype=dtype),
        )


def verify(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingConfig,
    rng: torch.Generator | None = None,
    temperature: torch.Tensor | None = None,
    uniforms: Uniforms | None = None,
) -> Verdict:
    """Decide acceptance for a batch of draft runs.

    Args:
        draft_tokens: [B, k] proposed tokens (entries past a row's length are ignored).
            Every tensor argument and the generator are on the device of ``target_logits``.
        draft_lengths: [B] how many of the k tokens each row really proposed.
        target_logits: [B, k + 1, V] target logits; position i scores draft token i,
            position k gives the bonus token.
        draft_probs: [B, k, V] the (shaped) distributions the drafts were drawn from,
            or None when the drafter is deterministic (one-hot q).
        sampling: the shaping applied to the target logits (and already to draft_probs).
        rng: random source where ``uniforms`` is None.
        temperature: [B, k + 1] per-position temperatures replacing ``sampling.temperature`` (a scheduled
            temperature), or None.
        uniforms: what decides each position when sampling (see :class:`Uniforms`), or None: drawn with ``rng``.
    """
    if sampling.greedy:
        return verify_greedy(draft_tokens, draft_lengths, greedy(target_logits))
    k = draft_tokens.shape[1]
    in_range = torch.arange(k, device=target_logits.device)[None, :] < draft_lengths[:, None]
    p = to_probs(target_logits, sampling, temperature)
    if uniforms is None:
        uniforms = Uniforms.drawn((p.shape[0], k + 1), (p.shape[0], k), p.device, rng)
    if draft_probs is None:  # the target draws every position; a draft token is kept while it is the target's draw
        choice = draw(p, uniform=uniforms.sample)
        accepted = leading_true((draft_tokens == choice[:, :k]) & in_range)
        return Verdict(accepted, choice.gather(1, accepted[:, None]).squeeze(1))

    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ok = (uniforms.accept * q_draft < p_draft) & in_range  # u < p/q without dividing by zero
    accepted = leading_true(ok)

    rows = torch.arange(p.shape[0], device=p.device)
    p_next = p[rows, accepted]
    rejected = accepted < draft_lengths
    if rejected.any():
        at = accepted.clamp(max=max(k - 1, 0))
        p_next = torch.where(rejected[:, None], residual_distribution(p_next, draft_probs[rows, at]), p_next)
    next_token = draw(p_next, uniform=uniforms.sample[rows, accepted])
    return Verdict(accepted, next_token)


def verify_greedy(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor, argmax: torch.Tensor) -> Verdict:
    """Greedy verdicts for a batch of draft runs from the target's argmax [B, k + 1] at each position (see ``verify``
    for the others). A draft token is accepted while it is the target's argmax."""
    k = draft_tokens.shape[1]
    in_range = torch.arange(k, device=argmax.device)[None, :] < draft_lengths[:, None]
    accepted = leading_true((draft_tokens == argmax[:, :k]) & in_range)
    return Verdict(accepted, argmax.gather(1, accepted[:, None]).squeeze(1))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; falls back to p where p <= q everywhere (then p == q)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=1e-30), p)


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row."""
    return mask.long().cumprod(dim=1).sum(dim=1)
