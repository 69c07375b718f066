"""Which verifier judges which rows: the dispatch from a row's kind to the math of this package.

A row's :class:`Rule` is fixed by its settings when it joins; with the shape of the step's drafts (a chain, or a tree)
it makes the :class:`Kind` that picks one function of :data:`VERIFIERS`. Rows of one kind are judged together where
the math allows (greedy chains and greedy trees in one call each), the others one by one with their own uniforms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from specdec.config import SamplingConfig, TypicalAcceptance
from specdec.verification.rejection import Uniforms, verify, verify_greedy
from specdec.verification.sampling import greedy
from specdec.verification.tree import verify_tree_greedy, verify_tree_sampled
from specdec.verification.typical import typical_verify


class Rule(Enum):
    """How a row's drafts are judged, fixed by its settings when it joins."""

    GREEDY = "greedy"  # exact: each accepted token is the target's argmax
    SAMPLED = "sampled"  # exact: rejection sampling, the produced tokens follow the target's law
    TYPICAL = "typical"  # lossy, opted into: typical acceptance (chains only), greedy or sampled next token

    @staticmethod
    def of(sampling: SamplingConfig, typical: TypicalAcceptance | None) -> Rule:
        if typical is not None:
            return Rule.TYPICAL
        return Rule.GREEDY if sampling.greedy else Rule.SAMPLED


@dataclass(frozen=True)
class Kind:
    """What picks a row's verifier at a step: its rule, and whether the step's drafts are a tree."""

    rule: Rule
    tree: bool


@dataclass(frozen=True)
class RowDrafts:
    """One row of a batch as its verifier reads it, besides the batch's tensors (:class:`Drafts`)."""

    kind: Kind
    size: int  # its draft nodes, n
    sampling: SamplingConfig
    typical: TypicalAcceptance | None  # the typical rule's thresholds (Rule.TYPICAL)
    probs: torch.Tensor | None  # [n, V] the distributions the drafts were drawn from (any device); None: deterministic
    temperature: torch.Tensor | None  # [n + 1] per-position temperatures replacing the sampling's (a guard's), or None
    uniforms: Uniforms | None  # what decides a sampled verdict: sample [n + 1], accept [n]; None when greedy


@dataclass(frozen=True)
class Drafts:
    """Every row's drafts and what the target says of them, on its device; row i's nodes are its first counts[i].

    The target's say is its logits, or (a batch of greedy rows whose logits nothing reshapes) only their argmaxes."""

    tokens: torch.Tensor  # [B, width]
    parents: torch.Tensor  # [B, width]: a tree's parents, a chain's i - 1
    counts: torch.Tensor  # [B]
    logits: torch.Tensor | None  # [B, width + 1, V], column j of row i judging its draft j
    rows: list[RowDrafts]
    argmaxes: torch.Tensor | None = None  # [B, width + 1]: each column's argmax, where the target gave those alone

    def __post_init__(self) -> None:
        if (self.logits is None) == (self.argmaxes is None):
            raise ValueError("drafts are judged from the target's logits or from its argmaxes: one of the two")

    def argmax(self, pick: slice | torch.Tensor) -> torch.Tensor:
        """The target's argmax at each column of the rows ``pick``."""
        return self.argmaxes[pick] if self.argmaxes is not None else greedy(self.logits[pick])


#: A verifier judges the rows ``members`` of a batch, all of one kind: each one's accepted nodes (root first) and the
#: target's next token, recovered or bonus (see the package docstring).
Verifier = Callable[[list[int], Drafts], list[tuple[list[int], int]]]


def judge(drafts: Drafts) -> list[tuple[list[int], int]]:
    """Each row's accepted nodes and next token, in row order; rows of one kind go to their verifier together."""
    groups: dict[Kind, list[int]] = {}
    for i, row in enumerate(drafts.rows):
        groups.setdefault(row.kind, []).append(i)
    verdicts: list[tuple[list[int], int]] = [([], -1)] * len(drafts.rows)
    for kind, members in groups.items():
        for i, verdict in zip(members, VERIFIERS[kind](members, drafts), strict=True):
            verdicts[i] = verdict
    return verdicts


def _greedy_chains(members: list[int], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact greedy chains, all at once."""
    pick = slice(None) if len(members) == len(d.rows) else torch.tensor(members).to(d.tokens.device)
    return verify_greedy(d.tokens[pick], d.counts[pick], d.argmax(pick)).per_row()


def _greedy_trees(members: list[int], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact greedy trees, all at once."""
    pick = torch.tensor(members).to(d.tokens.device)
    return verify_tree_greedy(d.tokens[pick], d.parents[pick], d.counts[pick], d.argmax(pick)).per_row()


def _sampled_chains(members: list[int], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact rejection sampling, each row with its own uniforms (and guard temperatures)."""
    verdicts = []
    for i in members:
        row = d.rows[i]
        probs = None if row.probs is None else row.probs.to(d.logits.device)[None]
        tokens, counts, logits, temperature, uniforms = _alone(i, d)
        verdicts += verify(tokens, counts, logits, probs, row.sampling, None, temperature, uniforms).per_row()
    return verdicts


def _sampled_trees(members: list[int], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact recursive rejection sampling over each row's tree."""
    verdicts = []
    for i in members:
        row, n = d.rows[i], d.rows[i].size
        probs = None if row.probs is None else row.probs.to(d.logits.device)
        tokens, parents, logits = d.tokens[i, :n], d.parents[i, :n], d.logits[i, : n + 1]
        verdict = verify_tree_sampled(tokens, parents, logits, probs, row.sampling, None, row.temperature, row.uniforms)
        verdicts += verdict.per_row()
    return verdicts


def _typical_chains(members: list[int], d: Drafts) -> list[tuple[list[int], int]]:
    """Typical acceptance (lossy, opted into), each row with its own uniforms."""
    verdicts = []
    for i in members:
        row = d.rows[i]
        tokens, counts, logits, temperature, uniforms = _alone(i, d)
        verdict = typical_verify(tokens, counts, logits, row.sampling, row.typical, None, temperature, uniforms)
        verdicts += verdict.per_row()
    return verdicts


def _alone(i: int, d: Drafts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Uniforms | None]:
    """Row i's drafts, their count, logits, temperatures and uniforms, as a batch of one chain."""
    row, n = d.rows[i], d.rows[i].size
    temperature = None if row.temperature is None else row.temperature[None]
    uniforms = None if row.uniforms is None else Uniforms(row.uniforms.sample[None], row.uniforms.accept[None])
    return d.tokens[i : i + 1, :n], d.counts[i : i + 1], d.logits[i : i + 1, : n + 1], temperature, uniforms


#: One verifier per kind. A tree judged by typical acceptance has none: it is refused before (not tree-aware).
VERIFIERS: dict[Kind, Verifier] = {
    Kind(Rule.GREEDY, tree=False): _greedy_chains,
    Kind(Rule.GREEDY, tree=True): _greedy_trees,
    Kind(Rule.SAMPLED, tree=False): _sampled_chains,
    Kind(Rule.SAMPLED, tree=True): _sampled_trees,
    Kind(Rule.TYPICAL, tree=False): _typical_chains,
}
