"""The dynamic k_cap: the batch's cap on every row's k in a step, chosen from the load.

One sequence verifies k + 1 tokens for little more than the price of one,
because a one-token forward leaves the machine idle. A batch of B rows
verifies B(k + 1) tokens, and once that forward is compute-bound every draft
token costs nearly what a real one does. The dynamic k_cap is the k that
maximises the batch's expected tokens per second under the measured cost of a
forward over B rows of n tokens, given each row's acceptance rate: it shrinks
as the batch grows, reaches 0 (plain batched decoding) when speculation stops
paying, and comes back when the batch shrinks. Above a memory threshold it is
0 too: drafts cost cache slots and a [B, k + 1, V] block of logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from specdec.scheduling.k_policy import CostCurve, expected_tokens


@dataclass(frozen=True)
class BatchCostCurve:
    """Seconds of one target forward over B rows of n new tokens, measured at a few B; linear in B in between,
    proportional beyond."""

    by_rows: dict[int, CostCurve]

    def __post_init__(self) -> None:
        if 1 not in self.by_rows:
            raise ValueError("a batch cost curve needs a measurement at one row")

    def __call__(self, rows: int, n: int) -> float:
        sizes = sorted(self.by_rows)
        if rows in self.by_rows:
            return self.by_rows[rows](n)
        above = min((s for s in sizes if s > rows), default=None)
        if above is None:
            return self.by_rows[sizes[-1]](n) * rows / sizes[-1]
        below = max(s for s in sizes if s < rows)
        share = (rows - below) / (above - below)
        return self.by_rows[below](n) * (1 - share) + self.by_rows[above](n) * share


def memory_in_use(device: torch.device) -> float:
    """Share of memory in use: allocated against total on CUDA; this process's resident memory against what it could
    have on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / torch.cuda.get_device_properties(device).total_memory
    resident = psutil.Process().memory_info().rss
    return resident / (resident + psutil.virtual_memory().available)


class DynamicKCap:
    """Caps every row's k for the coming step from batch size, memory in use and acceptance rates."""

    def __init__(
        self,
        costs: BatchCostCurve,
        memory_threshold: float = 0.8,
        memory: Callable[[], float] = lambda: memory_in_use(torch.device("cpu")),
    ) -> None:
        if not 0 < memory_threshold <= 1:
            raise ValueError(f"memory_threshold must be in (0, 1], got {memory_threshold}")
        self.costs = costs
        self.memory_threshold = memory_threshold
        self.memory = memory

    def expected_rate(self, k: int, acceptances: list[float], draft_s_per_token: float) -> float:
        """Expected tokens per second of the whole batch in a step drafting k tokens per row."""
        tokens = sum(expected_tokens(a, k) for a in acceptances)
        return tokens / (self.costs(len(acceptances), k + 1) + len(acceptances) * k * draft_s_per_token)

    def choose(self, acceptances: list[float], draft_s_per_token: float, max_k: int) -> int:
        """The k_cap, at most ``max_k``, for a step over rows with these acceptance estimates (0 = no speculation)."""
        if not acceptances or self.memory() > self.memory_threshold:
            return 0
        return max(range(max_k + 1), key=lambda k: self.expected_rate(k, acceptances, draft_s_per_token))
