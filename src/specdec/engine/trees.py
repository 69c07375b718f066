"""Tree steps: where a row that drafts trees differs from the chain path of the speculative step (engine/step.py).

A tree row (branches > 1, a drafter that declares trees; chosen when it joins) asks its k policy at each step whether
to draft a tree or a chain (``KPlan.tree``); a tree step of a scoring drafter under a plan that prices nodes
(``KPlan.price``) asks for the most nodes, k, which their scores cut after. Drafts that branch make a tree step:

- **score**: the target reads the nodes in the row's one forward, each seeing the context and its own ancestors;
- **verify**: a tree verifier judges them (verification/verifiers.py); a sampled verdict's uniforms are keyed by each
  level's position and each node's rank among its siblings;
- **commit**: the accepted path moves next to the context in the cache, and the step's logits are those along it.

Drafts that do not branch make a chain step, as a chain row's. Guards and typical acceptance are not tree-aware: a tree
with either is refused.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Proposal
from specdec.engine.rows import CHAINS, DraftPlan, Row, RowStep, Shape
from specdec.errors import ConfigError
from specdec.models.backend import RowBackend
from specdec.scheduling import KPlan
from specdec.seeds import ACCEPT, SAMPLE
from specdec.verification import Uniforms


class Trees(Shape):
    """A tree row's tree steps."""

    tree = True

    def plan(self, row: Row, chosen: KPlan, room: int) -> DraftPlan:
        """A tree (``branches`` children a node) where the policy's plan drafts one this step, else a chain."""
        branches = row.config.branches if chosen.tree else 1
        # A tree step of a scoring drafter under a plan that prices nodes asks for the most nodes: their scores cut
        # them after.
        priced = branches > 1 and chosen.price is not None and row.drafter.capabilities.scores
        return DraftPlan(chosen.k, min(row.config.k if priced else chosen.k, room), branches, price=chosen.price)

    def drafted(self, row: Row, proposal: Proposal) -> Shape:
        """The shape of ``row``'s drafts this step, whatever the row's own (a chain row's drafter may draft a tree
        unasked): a chain, or a tree; ConfigError for a tree the row cannot take."""
        if not proposal.is_tree:
            return CHAINS
        if row.config.guards.active or row.config.typical_acceptance is not None:
            raise ConfigError(
                "a tree row cannot use guards or typical acceptance (neither is tree-aware): set branches to 1"
            )
        return self

    def tree_of(self, proposal: Proposal) -> torch.Tensor | None:
        return proposal.parents

    def uniforms(self, row: Row, proposal: Proposal, device: torch.device) -> Uniforms:
        """Level l at position row.length + l; node j's acceptance keyed by its position and its rank among its
        siblings."""
        parents = proposal.parents.tolist()  # a tree has parents
        start, depths, ranks, children = row.length, [], [], {}
        for parent in parents:
            depths.append(depths[parent] + 1 if parent >= 0 else 0)
            ranks.append(children.get(parent, 0))
            children[parent] = ranks[-1] + 1
        draws = [(SAMPLE, start + level, 0) for level in range(len(parents) + 1)]
        draws += [(ACCEPT, start + depth, rank) for depth, rank in zip(depths, ranks, strict=True)]
        values = row.seeds.uniforms(device, draws)
        return Uniforms(values[: len(parents) + 1], values[len(parents) + 1 :])

    def keep(self, target: RowBackend, step: RowStep) -> slice | list[int]:
        """The accepted path moves next to the context in the cache; its columns: the root's, then each node's."""
        row, path = step.row, step.path
        target.truncate(step.row_id, row.length + len(path), [row.length + j for j in path])
        return [0] + [j + 1 for j in path]


TREES = Trees()
