"""Chain two drafters: the first proposes when it can, the second otherwise.

Prompt lookup is free and right whenever the text repeats its context; a
distilled model costs a little and helps on new text. Asking the cheap one
first gets both. The second drafter's cache simply lags while the first one
drafts: on its next call it reads the tokens it missed.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, DraftSettings, Proposal


class FallbackDrafter:
    def __init__(self, first: Drafter, second: Drafter) -> None:
        self.first, self.second = first, second
        self.vocab_size = second.vocab_size if second.vocab_size is not None else first.vocab_size
        self.backend = second.backend if second.backend is not None else first.backend  # the costlier one prices a draft token
        self._readers = [d for d in (first, second) if getattr(d, "wants_features", False)]  # drafters of the target's hidden states
        self.wants_features = bool(self._readers)
        self.scored = getattr(second, "scored", False)  # its proposals may carry scores (the first's are cut to the policy's k)
        self._last: Drafter = first

    def begin(self, settings: DraftSettings) -> None:
        self.first.begin(settings)
        self.second.begin(settings)
        self._last = self.first

    def propose(self, context: torch.Tensor, k: int) -> Proposal:
        proposal = self.first.propose(context, k)
        self._last = self.first
        if not len(proposal):
            proposal = self.second.propose(context, k)
            self._last = self.second
        return proposal

    def accept(self, n: int) -> None:
        self._last.accept(n)

    def observe_features(self, features: torch.Tensor) -> None:
        for drafter in self._readers:  # every step, whichever drafted: a reader must see every position
            drafter.observe_features(features)

    def fork(self) -> FallbackDrafter:
        return FallbackDrafter(self.first.fork(), self.second.fork())
