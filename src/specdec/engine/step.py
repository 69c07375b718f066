"""The speculative step in four phases: draft, score, verify, commit.

One step, for rows of any number (batch 1 is a batch: one sequence decodes on a
:class:`~specdec.models.backend.OneRow` backend):

1. **draft**: each row's :class:`DraftPlan` (``Row.plan``: its k policy's plan, capped by the batch's k_cap and the
   row's limits: a step yields the accepted drafts plus one target token, never past max_new_tokens or the context;
   nothing on a guard's anchor step), then its drafter's proposal, cut to what the row keeps;
2. **score**: each row is fed the tokens its cache lacks (the prompt at its first step, or its last token where rows
   that share a prompt had it read for them; afterwards the pending token, the last one produced) followed by its
   drafts, all rows in ONE target forward, which returns each position's logits, or only its argmax where every row
   is greedy and nothing reshapes its logits (``Row.argmax_only``: the target then need not write them);
3. **verify**: each row's logits are processed (bias and penalties, verification/processors.py, then its grammar's
   mask, grammar.py: each position from its own context, drafts included), its guards adjust them, then the verifier
   of its kind judges the drafts (verification/verifiers.py). A sampled row's uniforms are keyed by position
   (seeds.py): the token at position t is decided by the same numbers whichever step reaches it, so its k policy, the
   batch's k_cap and its drafter's history change no seeded output but through the drafts themselves (and
   deterministic drafts not at all);
4. **commit**: each row's cache keeps its accepted drafts, its tokens grow (its grammar's state with them), and its
   drafter, k policy, acceptance estimate, stats and guards observe the step's :class:`StepOutcome`.

The rows, their steps' records and the :class:`Shape` seam are in engine/rows.py. Where a tree differs from a chain,
the phases ask a shape: a row's own, chosen when it joins, plans its step (chains, :data:`CHAINS`, or, for a row with
branches > 1 whose drafter drafts trees, trees: engine/trees.py); the shape of its drafts (a chain or a tree, decided
by ``TREES.drafted``) scores, keys and keeps them.

Invariant between steps: the target's cache holds every token of a row but the pending one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdec.engine.rows import CHAINS, DraftPlan, Row, RowStep, Shape, Timer, align, gather_drafts
from specdec.engine.trees import TREES
from specdec.models.backend import RowBackend
from specdec.scheduling import StepOutcome
from specdec.verification import judge

__all__ = [
    "CHAINS",
    "DraftPlan",
    "Row",
    "RowStep",
    "Shape",
    "Timer",
    "commit",
    "draft",
    "score",
    "speculative_step",
    "verify_rows",
]


@torch.inference_mode()
def speculative_step(
    target: RowBackend, row_ids: list[int], rows: list[Row], k_cap: int | None = None
) -> list[StepOutcome]:
    """Advance ``rows`` (held in ``target``'s rows ``row_ids``) by one speculative step; ``k_cap`` caps every k."""
    steps = [
        RowStep(row=r, row_id=i, plan=r.plan(k_cap, target.max_context)) for r, i in zip(rows, row_ids, strict=True)
    ]
    for step in steps:
        draft(step)
    argmax = all(step.row.argmax_only for step in steps)  # the target need not write logits
    with Timer() as judging:
        scores = score(target, steps, argmax)
        verify_rows(steps, scores, argmax)
    hidden = target.last_features if any(step.row.reads_features for step in steps) else None
    return [
        commit(target, step, None if argmax else scores[i], None if hidden is None else hidden[i], judging.seconds)
        for i, step in enumerate(steps)
    ]


def draft(step: RowStep) -> None:
    """Phase 1: the drafter's proposal (where the row's plan asks for one), cut to what the plan keeps and what the row
    can accept; its tokens on the host, and its shape (a chain row's drafter may draft a tree unasked)."""
    row, planned = step.row, step.plan
    if not planned.asked:
        return
    with Timer() as drafting:
        proposal = row.drafter.propose(row.tokens, planned.asked, planned.branches)
        proposal = row.admit(proposal.cut(planned.keeps(proposal, drafting.elapsed)))
        step.proposal, step.shape = replace(proposal, tokens=proposal.tokens.cpu()), TREES.drafted(row, proposal)
    step.draft_s = drafting.seconds


def score(target: RowBackend, steps: list[RowStep], argmax: bool = False) -> torch.Tensor:
    """Phase 2: one target forward over every row's uncached tokens and drafts: logits [B, width + 1, V] (with
    ``argmax``, their argmaxes [B, width + 1]), position j of row i judging that row's draft j."""
    feeds = [step.feed(target.cached_lengths[step.row_id]) for step in steps]
    sizes, trees = [len(step.proposal) for step in steps], [step.shape.tree_of(step.proposal) for step in steps]
    forward = target.forward_argmax if argmax else target.forward
    reads_hidden = any(step.row.reads_features for step in steps)
    return align(forward([step.row_id for step in steps], feeds, max(sizes) + 1, trees, reads_hidden), sizes)


def verify_rows(steps: list[RowStep], scores: torch.Tensor, argmax: bool = False) -> None:
    """Phase 3: each row's logits shaped as target-only decoding shapes them, then each row's drafts judged by the
    verifier of its kind (with ``argmax``, the scores are the target's argmaxes: no row's logits are reshaped)."""
    for step, (path, token) in zip(steps, judge(gather_drafts(steps, scores, argmax)), strict=True):
        step.path, step.next_token = path, token


def commit(
    target: RowBackend, step: RowStep, logits: torch.Tensor | None, hidden: torch.Tensor | None, target_s: float
) -> StepOutcome:
    """Phase 4: the row's cache keeps its accepted drafts, its tokens grow, and the row observes the outcome
    (``logits``: the row's aligned logits, None after an argmax step; ``hidden``: its fed positions' states)."""
    columns = step.shape.keep(target, step)
    new_tokens = torch.cat([step.proposal.tokens[step.path], torch.tensor([step.next_token])])
    step.teach_drafter(hidden)
    step.row.extend(new_tokens)
    outcome = step.outcome(new_tokens, None if logits is None else logits[columns], target_s)
    step.row.observe(outcome)
    return outcome
