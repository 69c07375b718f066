"""How many tokens to draft at each step.

A fixed k is too few on easy text and too many on hard text, and what "too
many" means depends on the runtime: verifying 9 tokens costs 1.2x one token for
transformers in bfloat16 on this CPU but 5.5x for llama.cpp. A policy chooses k
before each step and observes the step's outcome after it; it never sees a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class KPolicy(Protocol):
    """Chooses the draft length of each step of one sequence."""

    def choose(self) -> int:
        """The number of tokens to draft now (0 = a plain target step)."""
        ...

    def observe(self, proposed: int, accepted: int, draft_s: float) -> None:
        """Learn from the step just taken: tokens drafted, how many the target accepted, seconds spent drafting."""
        ...


@dataclass
class FixedK:
    """Always the same k: the baseline every adaptive policy is measured against."""

    k: int

    def choose(self) -> int:
        return self.k

    def observe(self, proposed: int, accepted: int, draft_s: float) -> None:
        pass


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one target forward over n tokens, measured at a few n; linear in between and beyond."""

    seconds: dict[int, float]

    def __post_init__(self) -> None:
        if not self.seconds or min(self.seconds) != 1:
            raise ValueError("a cost curve needs a measurement at n = 1")

    def __call__(self, n: int) -> float:
        sizes = sorted(self.seconds)
        if n in self.seconds:
            return self.seconds[n]
        below = max((s for s in sizes if s < n), default=sizes[0])
        above = min((s for s in sizes if s > n), default=None)
        if above is None:  # beyond the last measurement: extend the last segment's slope
            if len(sizes) == 1:
                return self.seconds[below] * n
            below, above = sizes[-2], sizes[-1]
        slope = (self.seconds[above] - self.seconds[below]) / (above - below)
        return self.seconds[below] + slope * (n - below)


class CostModelK:
    """Pick the k that maximises expected tokens per second under this machine's costs.

    The acceptance rate a is estimated online from decayed counts, so it follows
    the text from easy to hard stretches; with k drafts a step yields
    (1 - a^(k+1)) / (1 - a) tokens in expectation (Leviathan et al.) and costs a
    target forward over k + 1 tokens plus k draft steps. When no drafts are
    observed (k = 0 chosen, or the drafter found nothing) the estimate relaxes
    toward an optimistic prior, so drafting is retried after a bad stretch.
    """

    def __init__(self, max_k: int, costs: CostCurve, decay: float = 0.9, prior: float = 0.8, prior_weight: float = 1.0) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.max_k = max_k
        self.costs = costs
        self.decay = decay
        self.prior = prior
        self.prior_weight = prior_weight
        self._accepted = 0.0  # decayed count of accepted drafts
        self._tried = 0.0  # decayed count of drafts the target judged
        self._draft_s_per_token = 0.0
        self._chosen = 0

    @property
    def acceptance(self) -> float:
        return (self._accepted + self.prior * self.prior_weight) / (self._tried + self.prior_weight)

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second of a step drafting k tokens."""
        a = min(self.acceptance, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (self.costs(k + 1) + k * self._draft_s_per_token)

    def choose(self) -> int:
        self._chosen = max(range(self.max_k + 1), key=self.expected_rate)
        return self._chosen

    def observe(self, proposed: int, accepted: int, draft_s: float) -> None:
        self._accepted *= self.decay
        self._tried *= self.decay
        if proposed:
            # Drafts after the first rejection were never judged: a rejection ends the run.
            self._accepted += accepted
            self._tried += accepted + (accepted < proposed)
        if self._chosen:
            per_token = draft_s / self._chosen
            self._draft_s_per_token += 0.5 * (per_token - self._draft_s_per_token)
