"""Chain two drafters: the first proposes when it can, the second otherwise.

Prompt lookup is free and right whenever the text repeats its context; a
distilled model costs a little and helps on new text. Asking the cheap one
first gets both. The second drafter's cache simply lags while the first one
drafts: on its next call it reads the tokens it missed.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig
from specdec.drafters.base import Drafter, Proposal
from specdec.verification.seeds import Seeds


class FallbackDrafter:
    def __init__(self, first: Drafter, second: Drafter) -> None:
        self.first, self.second = first, second
        self.vocab_size = second.vocab_size if second.vocab_size is not None else first.vocab_size
        self.backend = second.backend if second.backend is not None else first.backend  # the costlier one prices a draft token
        self._last: Drafter | None = None

    def begin(self, prompt: torch.Tensor) -> None:
        self.first.begin(prompt)
        self.second.begin(prompt)
        self._last = None

    def propose(
        self, context: torch.Tensor, k: int, sampling: SamplingConfig, seeds: Seeds | None, min_confidence: float = 0.0
    ) -> Proposal:
        proposal = self.first.propose(context, k, sampling, seeds, min_confidence=min_confidence)
        self._last = self.first
        if not proposal.tokens.shape[1]:
            proposal = self.second.propose(context, k, sampling, seeds, min_confidence=min_confidence)
            self._last = self.second
        return proposal

    def accepted(self, counts: torch.Tensor) -> None:
        if self._last is not None:
            self._last.accepted(counts)

    def fork(self) -> FallbackDrafter:
        return FallbackDrafter(self.first.fork(), self.second.fork())
