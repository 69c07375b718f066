"""The rows of the speculative step (engine/step.py): :class:`Row`, one sequence and what decides its steps (and the
row-level work the phases ask of it: planning, admitting drafts, shaping the target's logits, growing, observing an
outcome); :class:`RowStep`, one row's step as the phases fill it in (what it feeds the target, what its drafter
learns); :class:`DraftPlan`, how much it drafts; the batch's alignment (:func:`align`) and its drafts as the verifiers
read them (:func:`gather_drafts`); the step's clock, :class:`Timer`; and the :class:`Shape` seam with the chain shape,
:data:`CHAINS` (the tree shape builds on them in engine/trees.py)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdec.acceptance import AcceptanceEstimate
from specdec.config import GenerationConfig
from specdec.drafters.base import EVERYONE, Drafter, DraftSettings, HistoryScope, Proposal
from specdec.engine.stats import DecodeStats
from specdec.grammar import Constraint, NoConstraint
from specdec.guards import Guards, NoGuards
from specdec.models.backend import RowBackend
from specdec.scheduling import KPlan, KPolicy, NodePrice, StepOutcome
from specdec.seeds import ACCEPT, SAMPLE, Seeds
from specdec.verification import Drafts, Kind, RowDrafts, Rule, Uniforms
from specdec.verification.processors import process


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


@dataclass(frozen=True)
class DraftPlan:
    """How much one row drafts at a step."""

    chosen: int  # the k policy's choice: what the row keeps of a proposal (a scored one: what its policy prices)
    # nodes asked of the drafter: what the row wants within the batch's k_cap, its token budget and the context, each
    # leaving room for the target's own token of the step; 0: nothing is drafted
    asked: int = 0
    branches: int = 1  # the most children a draft node may have (1: a chain)
    anchored: bool = False  # a guard made this a target-only step
    price: NodePrice | None = None  # the policy's cut of a scored proposal (KPlan.price); None: cut to ``chosen``

    def keeps(self, proposal: Proposal, elapsed: float) -> int:
        """How many of ``proposal``'s nodes the row keeps: a scored one (a chain too) what the plan's price cuts it to,
        where the plan prices nodes (``elapsed``: the seconds its drafting took so far); any other, ``chosen``."""
        if proposal.scores is not None and self.price is not None:
            return self.price(proposal.scores, proposal.links, elapsed, proposal.draft_steps)
        return self.chosen


class Shape(ABC):
    """What a row drafts, chosen when it joins: chains (:data:`CHAINS`) or trees (engine/trees.py). The phases ask a
    row's shape how to plan its step, and the shape of its drafts (trees.py's ``TREES.drafted``) how to score, key and
    keep them."""

    #: the drafts branch: a tree verifier judges them
    tree: bool = False

    @abstractmethod
    def plan(self, row: Row, chosen: KPlan, room: int) -> DraftPlan:
        """The step's draft size from the k policy's plan ``chosen``, within ``room`` (> 0): the most drafts the row can
        use."""

    @abstractmethod
    def tree_of(self, proposal: Proposal) -> torch.Tensor | None:
        """The parents by which the target reads the drafts (each node sees the context and its ancestors); None for a
        chain."""

    @abstractmethod
    def uniforms(self, row: Row, proposal: Proposal, device: torch.device) -> Uniforms:
        """What decides a sampled verdict on ``device``, keyed by position (seeds.py): sample [n + 1], accept [n]."""

    @abstractmethod
    def keep(self, target: RowBackend, step: RowStep) -> slice | list[int]:
        """Keep the step's accepted drafts in the row's cache; return the columns of its aligned logits at its new
        tokens."""


class Chains(Shape):
    """A chain row's steps, and the chain steps of a tree row."""

    def plan(self, row: Row, chosen: KPlan, room: int) -> DraftPlan:
        return DraftPlan(chosen.k, min(chosen.k, room), price=chosen.price)

    def tree_of(self, proposal: Proposal) -> torch.Tensor | None:
        return None

    def uniforms(self, row: Row, proposal: Proposal, device: torch.device) -> Uniforms:
        """Draft j and the target's token in its place sit at position row.length + j, the bonus token at
        row.length + n."""
        start, n = row.length, len(proposal)
        values = row.seeds.uniforms(
            device, [(SAMPLE, start + j, 0) for j in range(n + 1)] + [(ACCEPT, start + j, 0) for j in range(n)]
        )
        return Uniforms(values[: n + 1], values[n + 1 :])

    def keep(self, target: RowBackend, step: RowStep) -> slice | list[int]:
        """A chain's accepted drafts are already next to the context: the rest of the cache goes."""
        target.truncate(step.row_id, step.row.length + len(step.path), None)
        return slice(0, len(step.path) + 1)


CHAINS = Chains()


@dataclass(eq=False)
class Row:
    """One sequence: its tokens and everything that decides its steps."""

    tokens: torch.Tensor  # [T] on the host: the prompt and every token accepted so far
    config: GenerationConfig
    drafter: Drafter
    policy: KPolicy
    seeds: Seeds  # what keys the sequence's random draws
    stats: DecodeStats
    prompt_length: int = field(kw_only=True)  # the penalties count the output's tokens, after the prompt's
    guards: Guards | NoGuards = field(default_factory=NoGuards)
    constraint: Constraint | NoConstraint = field(default_factory=NoConstraint)  # its grammar's state
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # what the batch's k_cap reads
    started: float = field(default_factory=time.perf_counter)
    scope: HistoryScope = EVERYONE  # whose history its drafter may share (DraftSettings.scope)
    shape: Shape = CHAINS  # what it drafts (trees.py's TREES for a row with branches > 1 whose drafter drafts trees)

    @property
    def rule(self) -> Rule:
        """How its drafts are judged, from its settings."""
        return Rule.of(self.config.sampling, self.config.typical_acceptance)

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def argmax_only(self) -> bool:
        """Whether its steps need of the target's logits only each position's argmax: greedy, exact, and nothing that
        reshapes or reads them (bias or penalties, a grammar, guards, logprobs, a k policy that reads them)."""
        c = self.config
        return (
            self.rule is Rule.GREEDY
            and not c.sampling.processed
            and c.logprobs is None
            and not (self.guards.reads_logits or self.constraint.reads_logits or self.policy.reads_logits)
        )

    @property
    def reads_features(self) -> bool:
        """Whether its drafter reads the target's hidden states (the target then returns them)."""
        return self.drafter.capabilities.features

    @property
    def draft_settings(self) -> DraftSettings:
        return DraftSettings(self.config.sampling, self.seeds, self.policy.min_confidence, self.scope)

    def plan(self, k_cap: int | None, max_context: int) -> DraftPlan:
        """How much it drafts this step: its k policy's plan within the batch's ``k_cap`` and the room it has left (a
        step yields the accepted drafts plus one target token, never past max_new_tokens or the context), nothing on
        a guard's anchor step; its shape sizes the draft within them. The policy is asked for a tree only where the row
        drafts trees and drafts this step."""
        anchored = self.guards.anchor_due(self.stats.new_tokens)
        room = min(self.config.max_new_tokens - self.stats.new_tokens, max_context - self.length) - 1
        room = room if k_cap is None else min(room, k_cap)
        drafts = not anchored and room > 0
        chosen = self.policy.plan(self.length, trees=drafts and self.shape.tree)
        if not drafts:
            return DraftPlan(chosen.k, anchored=anchored)
        return self.shape.plan(self, chosen, room)

    def admit(self, proposal: Proposal) -> Proposal:
        """``proposal`` cut to the drafts that could be accepted: deterministic ones to what the guards allow, then to
        what the grammar allows (a blocked or forbidden one would only be rejected); drawn ones stay (each is judged,
        rejected where p = 0, and its residual drawn)."""
        if proposal.probs is not None:
            return proposal
        with self.guarding():
            proposal = proposal.cut(self.guards.trim(self.tokens, proposal.tokens))
        return proposal.cut(self.constraint.allowed(proposal.tokens, proposal.links))

    def shape_logits(self, logits: torch.Tensor, proposal: Proposal) -> torch.Tensor | None:
        """Shape, in place, the target's ``logits`` [n + 1, V] at the proposal's positions as target-only decoding
        would, each from its own context, drafts included: bias and penalties (verification/processors.py), the
        grammar's mask, then the guards' adjustment; returns the guards' per-position temperatures, or None."""
        process(logits, self.tokens, self.prompt_length, proposal.tokens, proposal.links, self.config.sampling)
        self.constraint.mask(logits, proposal.tokens, proposal.links)
        with self.guarding():
            return self.guards.adjust(self.tokens, proposal.tokens, logits)

    def extend(self, new_tokens: torch.Tensor) -> None:
        """Append a step's new tokens (its grammar's state follows them)."""
        self.tokens = torch.cat([self.tokens, new_tokens])
        self.constraint.advance(new_tokens.tolist())

    def observe(self, outcome: StepOutcome) -> None:
        """Its k policy, acceptance estimate, stats and guards learn what the step did; after an anchor step the
        drafter starts over on the whole context."""
        self.policy.observe(outcome)
        self.acceptance.observe(outcome.depth, outcome.accepted)
        self.stats.record_step(outcome, time.perf_counter() - self.started)
        produced = len(outcome.new_tokens)
        self.stats.events += self.guards.settle(self.stats.new_tokens - produced, outcome.accepted, outcome.anchored)
        if outcome.anchored:
            self.drafter.begin(self.draft_settings)

    @contextmanager
    def guarding(self) -> Iterator[None]:
        """Count the time a guard hook takes in the row's stats."""
        with Timer() as guarding:
            yield
        self.stats.guard_s += guarding.seconds


@dataclass(kw_only=True)
class RowStep:
    """One row's step as the phases fill it in: planned and drafted, then fed to the target, then judged."""

    row: Row
    row_id: int  # the row's number in the RowBackend
    plan: DraftPlan
    proposal: Proposal = field(default_factory=Proposal.empty)
    shape: Shape = CHAINS  # the shape of its drafts
    draft_s: float = 0.0
    # tokens fed ahead of the drafts: the pending token, or at the first step the prompt (its last token where the
    # decoder read the rest for rows that share it)
    uncached: int = 0
    path: list[int] = field(default_factory=list)  # accepted draft nodes, root first
    next_token: int = -1  # the target's token after them, recovered or bonus

    def feed(self, cached: int) -> torch.Tensor:
        """What the target reads for this row, its cache holding ``cached`` tokens: the row's uncached tokens, then its
        drafts."""
        uncached = self.row.tokens[cached:]
        self.uncached = len(uncached)
        return torch.cat([uncached, self.proposal.tokens])

    def teach_drafter(self, hidden: torch.Tensor | None) -> None:
        """The drafter learns how many of its drafts were accepted (a step without drafts leaves its state as it was)
        and, where it reads them, the target's states at the positions kept (``hidden``: the fed positions')."""
        drafter = self.row.drafter
        if self.plan.asked:
            drafter.accept(len(self.path))
        if hidden is not None and drafter.capabilities.features:  # the fed context, then the accepted path
            kept = torch.cat([torch.arange(self.uncached), self.uncached + torch.tensor(self.path, dtype=torch.long)])
            drafter.observe_features(hidden[kept])

    def drafts(self, temperature: torch.Tensor | None, device: torch.device) -> RowDrafts:
        """The row as its verifier reads it (``temperature``: the guards' per-position temperatures, or None)."""
        row, proposal, sampling = self.row, self.proposal, self.row.config.sampling
        uniforms = None if sampling.greedy else self.shape.uniforms(row, proposal, device)
        kind = Kind(row.rule, self.shape.tree)
        return RowDrafts(
            kind, len(proposal), sampling, row.config.typical_acceptance, proposal.probs, temperature, uniforms
        )

    def outcome(self, new_tokens: torch.Tensor, logits: torch.Tensor | None, target_s: float) -> StepOutcome:
        """What the step did, for the row's observers (``logits``: the target's along the kept path, or None)."""
        proposal = self.proposal
        return StepOutcome(
            chosen=self.plan.chosen,
            asked=self.plan.asked,
            depth=proposal.depth,  # what a chain reaching as deep would have proposed: acceptance stays per position
            nodes=len(proposal),
            accepted=len(self.path),
            branched=self.shape.tree,
            draft_s=self.draft_s,
            draft_steps=proposal.draft_steps,
            target_s=target_s,
            read_prompt=self.uncached > 1,
            anchored=self.plan.anchored,
            context_length=self.row.length,
            logits=logits,
            new_tokens=new_tokens,
        )


def align(scores: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Shift each row's logits (or argmaxes) left, in place, by what it drafted less than the widest (feeds end in
    their drafts), so that column j of row i judges its draft j; columns past a row's drafts are left as they were
    (nobody reads them)."""
    width = scores.shape[1] - 1
    for i, n in enumerate(sizes):
        if n < width:  # copied row by row: a gather over the vocabulary would move every row and an index as large
            scores[i, : n + 1] = scores[i, width - n :].clone()
    return scores


def gather_drafts(steps: list[RowStep], scores: torch.Tensor, argmax: bool) -> Drafts:
    """The batch as the verifiers read it, each row's logits shaped first (Row.shape_logits: bias, penalties, grammar,
    guards); with ``argmax`` the scores are the target's argmaxes, which nothing reshapes."""
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
    return Drafts(tokens.to(device), parents.to(device), counts, logits, rows, argmaxes)
