"""The speculative step in four phases: draft, score, verify, commit.

One step, for rows of any number (batch 1 is a batch: one sequence decodes on a
:class:`~specdec.models.backend.OneRow` backend):

1. **draft**: each row's k policy chooses k, capped by the batch's window and the row's limits (a step yields the
   accepted drafts plus one target token, never past max_new_tokens or the context), and its drafter proposes up to
   k tokens (none on a guard's anchor step): a chain, or a tree when the row allows branches, its drafter drafts
   trees and its k policy chooses a tree this step;
2. **score**: each row is fed the tokens its cache lacks (the whole prompt at its first step, afterwards the pending
   token, the last one produced) followed by its drafts, all rows in ONE target forward (a tree's nodes each see only
   their ancestors);
3. **verify**: each row's guards adjust its logits, then the verifier judges the drafts; rows judged alike (greedy or
   sampled, chain or tree, exact or typical: ``VERIFIERS``) are judged together where the math allows. A sampled
   row's uniforms are keyed by position (seeds.py): the token at position t is decided by the same numbers whichever
   step reaches it, so its k policy, the batch's window and its drafter's history change no seeded output but
   through the drafts themselves (and deterministic drafts not at all);
4. **commit**: each row's cache keeps its accepted path (a tree's moved next to the context), its tokens grow, and
   its drafter, k policy, acceptance estimate, stats and guards observe the step's :class:`StepOutcome`.

Invariant between steps: the target's cache holds every token of a row but the pending one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from specdec.acceptance import AcceptanceEstimate
from specdec.config import GenerationConfig
from specdec.drafters.base import Drafter, DraftSettings, Proposal
from specdec.engine.stats import DecodeStats
from specdec.errors import ConfigError
from specdec.guards import Guards, NoGuards
from specdec.models.backend import RowBackend
from specdec.scheduling import KPolicy, StepOutcome
from specdec.seeds import ACCEPT, SAMPLE, Seeds
from specdec.verification import Uniforms, typical_verify, verify, verify_tree_greedy, verify_tree_sampled


class Timer:
    """Seconds spent inside ``with`` blocks (they add up): the step's one clock."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start

    @property
    def elapsed(self) -> float:
        """Seconds so far, read inside the block."""
        return self.seconds + time.perf_counter() - self._start


@dataclass(eq=False)
class Row:
    """One sequence: its tokens and everything that decides its steps."""

    tokens: torch.Tensor  # [T] on the host: the prompt and every token accepted so far
    config: GenerationConfig
    drafter: Drafter
    policy: KPolicy
    seeds: Seeds  # what keys the sequence's random draws
    stats: DecodeStats
    guards: Guards | NoGuards = field(default_factory=NoGuards)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # what the batch's window reads
    started: float = field(default_factory=time.perf_counter)
    scope: str | None = ""  # whose history its drafter may share (DraftSettings.scope)

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def draft_settings(self) -> DraftSettings:
        return DraftSettings(self.config.sampling, self.seeds, self.policy.min_confidence, self.scope)


@dataclass(kw_only=True)
class RowStep:
    """One row's step as the phases fill it in: drafted, then fed to the target, then judged."""

    row: Row
    row_id: int  # the row's number in the RowBackend
    chosen: int  # the k policy's choice
    asked: int = 0  # draft tokens asked of the drafter (0: none this step)
    anchored: bool = False  # a guard made this a target-only step
    proposal: Proposal = field(default_factory=Proposal.empty)
    draft_s: float = 0.0
    uncached: int = 0  # tokens fed ahead of the drafts: the pending token, or the whole prompt at the first step
    path: list[int] = field(default_factory=list)  # accepted draft nodes, root first
    next_token: int = -1  # the target's token after them, recovered or bonus


@torch.inference_mode()
def speculative_step(
    target: RowBackend, row_ids: list[int], rows: list[Row], window: int | None = None
) -> list[StepOutcome]:
    """Advance ``rows`` (held in ``target``'s rows ``row_ids``) by one speculative step; ``window`` caps every row's
    k."""
    steps = []
    for row, row_id in zip(rows, row_ids, strict=True):
        steps.append(draft(row, row_id, window, target.max_context))
    with Timer() as judging:
        logits = score(target, steps)
        verify_rows(steps, logits)
    reads_hidden = any(step.row.drafter.capabilities.features for step in steps)
    outcomes = []
    for i, step in enumerate(steps):
        hidden = target.last_features[i] if reads_hidden else None
        outcomes.append(commit(target, step, logits[i], hidden, judging.seconds))
    return outcomes


def draft(row: Row, row_id: int, window: int | None, max_context: int) -> RowStep:
    """Phase 1: the row's k, its chain or tree, and its drafter's proposal (cut to what the row keeps)."""
    chosen = row.policy.choose(row.length)
    anchored = row.guards.anchor_due(row.stats.new_tokens)
    step = RowStep(row=row, row_id=row_id, chosen=chosen, anchored=anchored)
    limit = min(row.config.max_new_tokens - row.stats.new_tokens, max_context - row.length) - 1
    if anchored or limit <= 0 or window == 0:
        return step
    branches = _branches(row)
    # A tree step of a scoring drafter under a pricing policy asks for the most nodes: their scores cut them after.
    priced = branches > 1 and row.policy.prices_nodes and row.drafter.capabilities.scores
    wanted = row.config.k if priced else chosen
    step.asked = max(0, min(wanted, limit, wanted if window is None else window))
    if not step.asked:
        return step
    with Timer() as drafting:
        step.proposal = _proposal(row, step.asked, branches, chosen, drafting)
    step.draft_s = drafting.seconds
    if step.proposal.is_tree and (row.config.guards.active or row.config.typical_acceptance is not None):
        raise ConfigError(
            "a tree row cannot use guards or typical acceptance (neither is tree-aware): set branches to 1"
        )
    return step


def _branches(row: Row) -> int:
    """The most children a draft node may have this step: the row's branches where its drafter drafts trees and its
    policy chooses a tree this step, else 1 (a chain)."""
    if row.config.branches == 1 or not row.drafter.capabilities.trees:
        return 1
    drafts_tree = row.policy.choose_tree()
    return row.config.branches if drafts_tree else 1


def _proposal(row: Row, asked: int, branches: int, chosen: int, drafting: Timer) -> Proposal:
    """The drafter's proposal of up to ``asked`` nodes, cut to what the row keeps: scored nodes to what its policy
    prices, others to the policy's choice (``chosen``), then deterministic tokens to what the guards allow; its tokens
    on the host (the context lives there; probabilities stay where they are, for the verifier)."""
    proposal = row.drafter.propose(row.tokens, asked, branches)
    if proposal.scores is not None and row.policy.prices_nodes:
        parents = proposal.parents if proposal.parents is not None else torch.arange(-1, len(proposal) - 1)
        size = row.policy.tree_size(proposal.scores, parents, drafting.elapsed, proposal.draft_steps)
        proposal = proposal.cut(size)
    else:
        proposal = proposal.cut(chosen)
    if proposal.probs is None:  # a deterministic draft token that a guard blocks would only be rejected
        with Timer() as guarding:
            allowed = row.guards.trim(row.tokens, proposal.tokens)
        row.stats.guard_s += guarding.seconds
        proposal = proposal.cut(allowed)
    return replace(proposal, tokens=proposal.tokens.cpu())


def score(target: RowBackend, steps: list[RowStep]) -> torch.Tensor:
    """Phase 2: one target forward over every row's missing context and drafts; logits [B, width + 1, V] with
    position j of row i judging that row's draft j."""
    feeds = []
    for step in steps:
        uncached = step.row.tokens[target.cached_lengths[step.row_id] :]
        step.uncached = len(uncached)
        feeds.append(torch.cat([uncached, step.proposal.tokens]))
    trees = [step.proposal.parents if step.proposal.is_tree else None for step in steps]
    sizes = [len(step.proposal) for step in steps]
    reads_hidden = any(step.row.drafter.capabilities.features for step in steps)
    logits = target.forward([step.row_id for step in steps], feeds, max(sizes) + 1, trees, reads_hidden)
    return _align(logits, sizes)


def _align(logits: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Shift each row's logits left, in place, by what it drafted less than the widest (feeds end in their drafts), so
    that column j of row i judges its draft j; columns past a row's drafts are left as they were (nobody reads them)."""
    width = logits.shape[1] - 1
    for i, n in enumerate(sizes):
        if n < width:  # copied row by row: a gather over the vocabulary would move every row and an index as large
            logits[i, : n + 1] = logits[i, width - n :].clone()
    return logits


class Drafts(NamedTuple):
    """Every row's drafts as the verifiers read them, on the logits' device; row i's nodes are its first counts[i]."""

    tokens: torch.Tensor  # [B, width]
    parents: torch.Tensor  # [B, width]: a tree's parents, a chain's i - 1
    counts: torch.Tensor  # [B]
    logits: torch.Tensor  # [B, width + 1, V], after the guards
    temperatures: list[torch.Tensor | None]  # per row: a guard's per-position temperatures


Verifier = Callable[[list[int], list[RowStep], Drafts], list[tuple[list[int], int]]]


def verify_rows(steps: list[RowStep], logits: torch.Tensor) -> None:
    """Phase 3: each row's guards adjust its logits, then each group of rows judged alike gets its verdicts."""
    device = logits.device
    sizes = [len(step.proposal) for step in steps]
    tokens = torch.zeros(len(steps), logits.shape[1] - 1, dtype=torch.long)
    parents = torch.full_like(tokens, -1)
    temperatures = []
    for i, step in enumerate(steps):
        proposal = step.proposal
        if sizes[i]:
            tokens[i, : sizes[i]] = proposal.tokens
            parents[i, : sizes[i]] = (
                proposal.parents if proposal.parents is not None else torch.arange(-1, sizes[i] - 1)
            )
        with Timer() as guarding:  # masks the row's logits in place
            temperature = step.row.guards.adjust(step.row.tokens, proposal.tokens, logits[i, : sizes[i] + 1])
        step.row.stats.guard_s += guarding.seconds
        temperatures.append(temperature)
    drafts = Drafts(tokens.to(device), parents.to(device), torch.tensor(sizes).to(device), logits, temperatures)
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for i, step in enumerate(steps):
        config = step.row.config
        key = (config.sampling.greedy, step.proposal.is_tree, config.typical_acceptance is not None)
        groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        verdicts = VERIFIERS[key](members, steps, drafts)
        for i, (path, token) in zip(members, verdicts, strict=True):
            steps[i].path, steps[i].next_token = path, token


def _greedy_chains(members: list[int], steps: list[RowStep], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact greedy chains, all at once."""
    pick = slice(None) if len(members) == len(steps) else torch.tensor(members).to(d.logits.device)
    sampling = steps[members[0]].row.config.sampling
    return verify(d.tokens[pick], d.counts[pick], d.logits[pick], None, sampling).per_row()


def _greedy_trees(members: list[int], steps: list[RowStep], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact greedy trees, all at once."""
    pick = torch.tensor(members).to(d.logits.device)
    return verify_tree_greedy(d.tokens[pick], d.parents[pick], d.counts[pick], d.logits[pick]).per_row()


def _sampled_chains(members: list[int], steps: list[RowStep], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact rejection sampling, each row with its own keyed uniforms (and guard temperatures)."""
    verdicts = []
    for i in members:
        step = steps[i]
        probs = None if step.proposal.probs is None else step.proposal.probs.to(d.logits.device)[None]
        tokens, counts, logits, temperature = _alone(i, len(step.proposal), d)
        uniforms = _chain_uniforms(step.row, len(step.proposal), d.logits.device)
        verdict = verify(tokens, counts, logits, probs, step.row.config.sampling, None, temperature, uniforms)
        verdicts += verdict.per_row()
    return verdicts


def _alone(i: int, n: int, d: Drafts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row i's n drafts, their count, logits and guard temperatures, as a batch of one."""
    temperature = d.temperatures[i]
    batched = None if temperature is None else temperature[None]
    return d.tokens[i : i + 1, :n], d.counts[i : i + 1], d.logits[i : i + 1, : n + 1], batched


def _chain_uniforms(row: Row, n: int, device: torch.device) -> Uniforms:
    """A row's uniforms for a chain of ``n`` drafts, as a batch of one: draft j and the target's token in its place sit
    at position row.length + j, the bonus token at row.length + n."""
    start = row.length
    draws = [(SAMPLE, start + j, 0) for j in range(n + 1)] + [(ACCEPT, start + j, 0) for j in range(n)]
    values = row.seeds.uniforms(device, draws)
    return Uniforms(values[None, : n + 1], values[None, n + 1 :])


def _tree_uniforms(row: Row, parents: list[int], device: torch.device) -> Uniforms:
    """A row's uniforms for a tree: level l at position row.length + l; node j's acceptance keyed by its position and
    its rank among its siblings."""
    start, depths, ranks, children = row.length, [], [], {}
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
        ranks.append(children.get(parent, 0))
        children[parent] = ranks[-1] + 1
    draws = [(SAMPLE, start + level, 0) for level in range(len(parents) + 1)]
    draws += [(ACCEPT, start + depth, rank) for depth, rank in zip(depths, ranks, strict=True)]
    values = row.seeds.uniforms(device, draws)
    return Uniforms(values[: len(parents) + 1], values[len(parents) + 1 :])


def _sampled_trees(members: list[int], steps: list[RowStep], d: Drafts) -> list[tuple[list[int], int]]:
    """Exact recursive rejection sampling over each row's tree."""
    verdicts = []
    for i in members:
        step = steps[i]
        n = len(step.proposal)
        probs = None if step.proposal.probs is None else step.proposal.probs.to(d.logits.device)
        verdict = verify_tree_sampled(
            d.tokens[i, :n],
            d.parents[i, :n],
            d.logits[i, : n + 1],
            probs,
            step.row.config.sampling,
            None,
            d.temperatures[i],
            _tree_uniforms(step.row, step.proposal.parents.tolist(), d.logits.device),  # a tree has parents
        )
        verdicts += verdict.per_row()
    return verdicts


def _typical_chains(members: list[int], steps: list[RowStep], d: Drafts) -> list[tuple[list[int], int]]:
    """Typical acceptance (lossy, opted into), each row with its own keyed uniforms."""
    verdicts = []
    for i in members:
        step, config = steps[i], steps[i].row.config
        tokens, counts, logits, temperature = _alone(i, len(step.proposal), d)
        uniforms = _chain_uniforms(step.row, len(step.proposal), d.logits.device)
        verdict = typical_verify(
            tokens, counts, logits, config.sampling, config.typical_acceptance, None, temperature, uniforms
        )
        verdicts += verdict.per_row()
    return verdicts


#: How rows are judged, keyed by (greedy, tree, typical acceptance). A tree with typical acceptance has no verifier:
#: the draft phase refuses it.
VERIFIERS: dict[tuple[bool, bool, bool], Verifier] = {
    (True, False, False): _greedy_chains,
    (True, True, False): _greedy_trees,
    (False, False, False): _sampled_chains,
    (False, True, False): _sampled_trees,
    (True, False, True): _typical_chains,
    (False, False, True): _typical_chains,
}


def commit(
    target: RowBackend, step: RowStep, logits: torch.Tensor, hidden: torch.Tensor | None, target_s: float
) -> StepOutcome:
    """Phase 4: keep the row's accepted path in the cache and its tokens, then let the row observe the outcome.
    ``logits``: the row's aligned logits; ``hidden``: its fed positions' hidden states, when a drafter of the batch
    reads them."""
    row, proposal, path = step.row, step.proposal, step.path
    tree = proposal.is_tree
    # A tree's accepted path moves next to the context in the cache; a chain's is already there.
    target.truncate(step.row_id, row.length + len(path), [row.length + j for j in path] if tree else None)
    if step.asked:  # a step without drafts leaves the drafter's state as it was
        row.drafter.accept(len(path))
    if hidden is not None and row.drafter.capabilities.features:  # the positions kept: the fed context, the path
        kept = torch.cat([torch.arange(step.uncached), step.uncached + torch.tensor(path, dtype=torch.long)])
        row.drafter.observe_features(hidden[kept])
    new_tokens = torch.cat([proposal.tokens[path], torch.tensor([step.next_token])])
    row.tokens = torch.cat([row.tokens, new_tokens])
    outcome = StepOutcome(
        chosen=step.chosen,
        asked=step.asked,
        depth=proposal.depth,  # what a chain reaching as deep would have proposed: acceptance stays per position
        nodes=len(proposal),
        accepted=len(path),
        branched=tree,
        draft_s=step.draft_s,
        draft_steps=proposal.draft_steps,
        target_s=target_s,
        read_prompt=step.uncached > 1,
        anchored=step.anchored,
        context_length=row.length,
        logits=logits[[0] + [j + 1 for j in path]] if tree else logits[: len(path) + 1],  # along the kept path
        new_tokens=new_tokens,
    )
    _observe(row, outcome)
    return outcome


def _observe(row: Row, outcome: StepOutcome) -> None:
    """The row's k policy, acceptance estimate, stats and guards learn what the step did; after an anchor step the
    drafter starts over on the whole context."""
    row.policy.observe(outcome)
    row.acceptance.observe(outcome.depth, outcome.accepted)
    row.stats.record_step(outcome, time.perf_counter() - row.started)
    produced = len(outcome.new_tokens)
    row.stats.events += row.guards.settle(row.stats.new_tokens - produced, outcome.accepted, outcome.anchored)
    if outcome.anchored:
        row.drafter.begin(row.draft_settings)
