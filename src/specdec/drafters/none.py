"""No drafting: the engine then runs plain target-only decoding, the baseline of every speed-up."""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig
from specdec.drafters.base import Proposal
from specdec.verification.seeds import Seeds


class NoDrafter:
    vocab_size = None
    backend = None  # no model drafts

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def propose(
        self, context: torch.Tensor, k: int, sampling: SamplingConfig, seeds: Seeds | None, min_confidence: float = 0.0
    ) -> Proposal:
        return Proposal.empty(context.shape[0], context.device)

    def accepted(self, counts: torch.Tensor) -> None:
        pass

    def fork(self) -> NoDrafter:
        return self  # no per-sequence state
