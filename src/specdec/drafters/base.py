"""The drafter protocol: propose candidate tokens; learn how many were accepted.

Every drafter (no model, n-gram, small model, ...) implements these four
methods and nothing else, so new drafters plug into the engine untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.config import SamplingConfig
from specdec.models.backend import Backend
from specdec.verification.seeds import Seeds


@dataclass(frozen=True)
class Proposal:
    """Candidate tokens for each batch row.

    ``probs`` holds the shaped distribution each token was drawn from, needed for
    exact rejection sampling; None means the drafter is deterministic (its
    distribution is one-hot on the proposed token), and in greedy mode.
    Its tensors may live on the drafter's device; the engine moves the proposal
    to the target's (:meth:`to`) before verifying it.
    """

    tokens: torch.Tensor  # [B, k] long
    lengths: torch.Tensor  # [B] long: how many of the k tokens each row proposes
    probs: torch.Tensor | None = None  # [B, k, V] float

    def to(self, device: torch.device) -> Proposal:
        """The same proposal on ``device`` (the verifier works where the target's logits are)."""
        probs = None if self.probs is None else self.probs.to(device)
        return Proposal(self.tokens.to(device), self.lengths.to(device), probs)

    def cut(self, length: int) -> Proposal:
        """The first ``length`` tokens (of a single-row proposal)."""
        if length >= self.tokens.shape[1]:
            return self
        probs = None if self.probs is None else self.probs[:, :length]
        return Proposal(self.tokens[:, :length], self.lengths.clamp(max=length), probs)

    @staticmethod
    def empty(batch: int, device: torch.device | str = "cpu") -> Proposal:
        return Proposal(
            torch.zeros(batch, 0, dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
        )


class Drafter(Protocol):
    """Proposes up to k next tokens for the current context."""

    #: logits width for model drafters (checked against the target's); None for vocabulary-free drafters
    vocab_size: int | None
    #: the model that drafts, None for model-free drafters; its measured one-token cost prices a draft token in seeded runs
    backend: Backend | None

    def begin(self, prompt: torch.Tensor) -> None:
        """Start a new sequence from ``prompt`` [B, T]."""
        ...

    def propose(
        self, context: torch.Tensor, k: int, sampling: SamplingConfig, seeds: Seeds | None, min_confidence: float = 0.0
    ) -> Proposal:
        """Propose up to ``k`` tokens following ``context`` [B, T] (every token so far, on the host).

        A drafter that samples draws with ``seeds.on(device)`` for the device it draws on.

        A drafter that has a probability for its tokens stops before the first one
        whose probability is below ``min_confidence``; others ignore it.
        """
        ...

    def accepted(self, counts: torch.Tensor) -> None:
        """Learn how many tokens [B] (on the host) of the last proposal the target accepted.

        Called after every step that called :meth:`propose`, never after a step without drafts (k = 0, an anchor).
        """
        ...

    def fork(self) -> Drafter:
        """A drafter with the same knowledge (weights, tables) and its own per-sequence state, for a sequence decoded alongside."""
        ...
