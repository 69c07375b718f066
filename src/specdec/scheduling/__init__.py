"""Scheduling decisions of the decode loop: how many tokens to draft at each step."""

from __future__ import annotations

from collections.abc import Callable

from specdec.acceptance import AcceptanceEstimate
from specdec.config import K_POLICIES
from specdec.errors import ConfigError
from specdec.scheduling.k_cap import BatchCostCurve, DynamicKCap, memory_in_use
from specdec.scheduling.k_policy import (
    ConfidenceK,
    CostCurve,
    CostModelK,
    FixedK,
    HeuristicK,
    KPlan,
    KPolicy,
    NodePrice,
    PerplexityK,
    StepOutcome,
    WayRates,
    expected_tokens,
)


def build_k_policy(
    name: str,
    k: int,
    costs: Callable[[], CostCurve],
    draft_cost: Callable[[], float] | None = None,
    tree_overhead: Callable[[], CostCurve] | None = None,
    ways: WayRates | None = None,
    tree_draft_cost: Callable[[], float] | None = None,
) -> KPolicy:
    """A fresh policy for one sequence; ``k`` is the fixed k or the adaptive policies' maximum.

    ``costs`` (and ``draft_cost``, seconds per draft step; ``tree_overhead``, a tree forward's seconds over a
    chain's, for sequences that may draft trees) are called only by policies that price forwards (they may measure
    them). Without ``draft_cost`` the cost model learns the draft's cost from live timings; with it,
    ``tree_draft_cost`` prices a level of a tree's drafting (default: a chain step's). ``ways``: tree and chain
    steps' rates shared with other rows, which a tree row's choice between them starts from
    (``CostModelK.choose_tree``, asked by its plans).
    """
    if name == "fixed":
        return FixedK(k)
    if name == "heuristic":
        return HeuristicK(k)
    if name == "perplexity":
        return PerplexityK(k)
    if name == "confidence":
        return ConfidenceK(k)
    if name == "cost-model":
        return CostModelK(
            k,
            costs(),
            draft_s_per_token=draft_cost() if draft_cost is not None else None,
            tree_overhead=tree_overhead() if tree_overhead is not None else None,
            ways=ways,
            tree_draft_s_per_step=tree_draft_cost() if tree_draft_cost is not None else None,
        )
    raise ConfigError(f"unknown k policy '{name}': use one of {', '.join(K_POLICIES)}")


__all__ = [
    "K_POLICIES",
    "AcceptanceEstimate",
    "BatchCostCurve",
    "DynamicKCap",
    "expected_tokens",
    "memory_in_use",
    "ConfidenceK",
    "CostCurve",
    "CostModelK",
    "FixedK",
    "HeuristicK",
    "KPlan",
    "KPolicy",
    "NodePrice",
    "PerplexityK",
    "StepOutcome",
    "WayRates",
    "build_k_policy",
]
