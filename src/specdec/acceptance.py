"""How often a drafter's tokens are accepted: an estimate that follows the text (k policies and drafters read it)."""

from __future__ import annotations


class AcceptanceEstimate:
    """The rate at which a drafter's tokens are accepted, from decayed counts, so it follows the text.

    When no drafts are judged (k = 0 chosen, or the drafter found nothing) the
    estimate relaxes toward an optimistic ``prior``, so drafting is retried after a bad stretch.
    """

    def __init__(self, decay: float = 0.9, prior: float = 0.8, prior_weight: float = 1.0) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.prior = prior
        self.prior_weight = prior_weight
        self._accepted = 0.0  # decayed count of accepted drafts
        self._tried = 0.0  # decayed count of drafts the target judged

    @property
    def value(self) -> float:
        return (self._accepted + self.prior * self.prior_weight) / (self._tried + self.prior_weight)

    def observe(self, proposed: int, accepted: int) -> None:
        self._accepted *= self.decay
        self._tried *= self.decay
        if proposed:
            # Drafts after the first rejection were never judged: a rejection ends the run.
            self._accepted += accepted
            self._tried += accepted + (accepted < proposed)
