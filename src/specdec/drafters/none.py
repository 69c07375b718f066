"""No drafting: the engine then runs plain target-only decoding, the baseline of every speed-up."""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, DraftSettings, Proposal


class NoDrafter(Drafter):
    vocab_size = None
    backend = None  # no model drafts

    def begin(self, settings: DraftSettings) -> None:
        pass

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        return Proposal.empty()

    def accept(self, n: int) -> None:
        pass

    def fork(self) -> NoDrafter:
        return self  # no per-sequence state
