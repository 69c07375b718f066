"""The speculative step in four phases: draft, score, verify, commit.

One step, for rows of any number (batch 1 is a batch: one sequence decodes on a
:class:`~specdec.models.backend.OneRow` backend):

1. **draft**: each row's :class:`DraftPlan` (its k policy's plan, capped by the batch's k_cap and the row's limits:
   a step yields the accepted drafts plus one target token, never past max_new_tokens or the context; nothing on a
   guard's anchor step), then its drafter's proposal, cut to what the row keeps;
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

from specdec.engine.rows import CHAINS, DraftPlan, Row, RowStep, Shape, Timer
from specdec.engine.trees import TREES
from specdec.models.backend import RowBackend
from specdec.scheduling import StepOutcome
from specdec.verification import Drafts, judge

__all__ = [
    "CHAINS",
    "DraftPlan",
    "Row",
    "RowStep",
    "Shape",
    "Timer",
    "commit",
    "draft",
    "plan",
    "score",
    "speculative_step",
    "verify_rows",
]


@torch.inference_mode()
def speculative_step(
    target: RowBackend, row_ids: list[int], rows: list[Row], k_cap: int | None = None
) -> list[StepOutcome]:
    """Advance ``rows`` (held in ``target``'s rows ``row_ids``) by one speculative step; ``k_cap`` caps every row's
    k."""
    steps = [
        RowStep(row=row, row_id=i, plan=plan(row, k_cap, target.max_context))
        for row, i in zip(rows, row_ids, strict=True)
    ]
    for step in steps:
        draft(step)
    argmax = all(step.row.argmax_only for step in steps)  # the target need not write logits
    with Timer() as judging:
        scores = score(target, steps, argmax)
        verify_rows(steps, scores, argmax)
    features = target.last_features if any(step.row.drafter.capabilities.features for step in steps) else None
    return [
        commit(target, step, None if argmax else scores[i], None if features is None else features[i], judging.seconds)
        for i, step in enumerate(steps)
    ]


def plan(row: Row, k_cap: int | None, max_context: int) -> DraftPlan:
    """Phase 1, how much: the k policy's plan within the batch's k_cap and the room the row has left (nothing on a
    guard's anchor step); the row's shape sizes the draft within them. The policy is asked for a tree only where the row
    drafts trees and drafts this step."""
    anchored = row.guards.anchor_due(row.stats.new_tokens)
    room = min(row.config.max_new_tokens - row.stats.new_tokens, max_context - row.length) - 1
    room = room if k_cap is None else min(room, k_cap)
    drafts = not anchored and room > 0
    chosen = row.policy.plan(row.length, trees=drafts and row.shape.tree)
    if not drafts:
        return DraftPlan(chosen.k, anchored=anchored)
    return row.shape.plan(row, chosen, room)


def draft(step: RowStep) -> None:
    """Phase 1: the drafter's proposal (where the plan asks for one), cut to what the plan keeps and what the row can
    accept, its tokens on the host (the context lives there; probabilities stay where they are, for the verifier),
    and its shape: a chain row's drafter may draft a tree unasked (trees.py judges whether the row can take one)."""
    row, planned = step.row, step.plan
    if not planned.asked:
        return
    with Timer() as drafting:
        proposal = row.drafter.propose(row.tokens, planned.asked, planned.branches)
        proposal = row.admit(proposal.cut(planned.keeps(proposal, drafting.elapsed)))
        step.proposal, step.shape = replace(proposal, tokens=proposal.tokens.cpu()), TREES.drafted(row, proposal)
    step.draft_s = drafting.seconds


def score(target: RowBackend, steps: list[RowStep], argmax: bool = False) -> torch.Tensor:
    """Phase 2: one target forward over every row's missing context and drafts; logits [B, width + 1, V] (with
    ``argmax``: their argmaxes [B, width + 1]) with position j of row i judging that row's draft j."""
    feeds = []
    for step in steps:
        uncached = step.row.tokens[target.cached_lengths[step.row_id] :]
        step.uncached = len(uncached)
        feeds.append(torch.cat([uncached, step.proposal.tokens]))
    trees = [step.shape.tree_of(step.proposal) for step in steps]
    sizes = [len(step.proposal) for step in steps]
    reads_hidden = any(step.row.drafter.capabilities.features for step in steps)
    forward = target.forward_argmax if argmax else target.forward
    scores = forward([step.row_id for step in steps], feeds, max(sizes) + 1, trees, reads_hidden)
    return _align(scores, sizes)


def _align(scores: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Shift each row's logits (or argmaxes) left, in place, by what it drafted less than the widest (feeds end in
    their drafts), so that column j of row i judges its draft j; columns past a row's drafts are left as they were
    (nobody reads them)."""
    width = scores.shape[1] - 1
    for i, n in enumerate(sizes):
        if n < width:  # copied row by row: a gather over the vocabulary would move every row and an index as large
            scores[i, : n + 1] = scores[i, width - n :].clone()
    return scores


def verify_rows(steps: list[RowStep], scores: torch.Tensor, argmax: bool = False) -> None:
    """Phase 3: each row shapes its logits (bias, penalties, grammar, guards: Row.shape_logits), then the verifier of
    each row's kind judges its drafts. With ``argmax`` the scores are the target's argmaxes (rows whose logits nothing
    reshapes)."""
    device, width = scores.device, scores.shape[1] - 1
    tokens, parents = torch.zeros(len(steps), width, dtype=torch.long), torch.full((len(steps), width), -1)
    rows = []
    for i, step in enumerate(steps):
        n = len(step.proposal)
        tokens[i, :n], parents[i, :n] = step.proposal.tokens, step.proposal.links
        temperature = None if argmax else step.row.shape_logits(scores[i, : n + 1], step.proposal)
        rows.append(step.drafts(temperature, device))
    counts = torch.tensor([len(step.proposal) for step in steps]).to(device)
    logits, argmaxes = (None, scores) if argmax else (scores, None)
    verdicts = judge(Drafts(tokens.to(device), parents.to(device), counts, logits, rows, argmaxes))
    for step, (path, token) in zip(steps, verdicts, strict=True):
        step.path, step.next_token = path, token


def commit(
    target: RowBackend, step: RowStep, logits: torch.Tensor | None, hidden: torch.Tensor | None, target_s: float
) -> StepOutcome:
    """Phase 4: keep the row's accepted drafts in the cache and its tokens, then let the row observe the outcome.
    ``logits``: the row's aligned logits (None after an argmax step); ``hidden``: its fed positions' hidden states,
    when a drafter of the batch reads them."""
    row, path = step.row, step.path
    columns = step.shape.keep(target, step)
    if step.plan.asked:  # a step without drafts leaves the drafter's state as it was
        row.drafter.accept(len(path))
    if hidden is not None and row.drafter.capabilities.features:  # the positions kept: the fed context, the path
        kept = torch.cat([torch.arange(step.uncached), step.uncached + torch.tensor(path, dtype=torch.long)])
        row.drafter.observe_features(hidden[kept])
    new_tokens = torch.cat([step.proposal.tokens[path], torch.tensor([step.next_token])])
    row.extend(new_tokens)
    outcome = step.outcome(new_tokens, None if logits is None else logits[columns], target_s)  # along the kept path
    row.observe(outcome)
    return outcome
