"""The speculative step: every row drafts, one target forward scores all drafts, each row keeps its accepted prefix.

One step, for rows of any number (batch 1 is a batch: single-sequence
generation runs it on a :class:`~specdec.models.backend.OneRow` backend):

1. each row's k policy chooses k, capped by the batch's window and the row's
   limits (a step yields the accepted drafts plus one target token, never past
   max_new_tokens or the context), and its drafter proposes up to k tokens
   (none on a guard's anchor step): a chain, or a tree of k nodes when the
   row's config allows branches and its k policy finds trees faster this step;
2. each row is fed the tokens its cache lacks (the whole prompt at its first
   step, afterwards the pending token, the last one produced) followed by its
   drafts, all rows in ONE target forward (a tree's nodes each see only their
   ancestors);
3. each row's guards adjust its logits, then the verifier judges the drafts:
   exact greedy chains in one vectorised call, exact greedy trees in another,
   every other row alone with its own random generator, on the device of the logits;
4. each row's cache is rolled back to its accepted path (a tree's path is moved
   next to the context), and its drafter, k policy and stats learn what happened.

Invariant between steps: the target's cache holds every token of a row but the pending one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from specdec.acceptance import AcceptanceEstimate
from specdec.config import GenerationConfig
from specdec.drafters.base import Drafter, DraftSettings, Proposal
from specdec.engine.stats import DecodeStats
from specdec.errors import ConfigError
from specdec.guards import Guards, NoGuards
from specdec.models.backend import RowBackend
from specdec.scheduling import KPolicy, StepOutcome
from specdec.seeds import Seeds
from specdec.verification import typical_verify, verify
from specdec.verification.tree import verify_tree_greedy, verify_tree_sampled


@dataclass(eq=False)
class Row:
    """One sequence: its tokens and everything that decides its steps."""

    tokens: torch.Tensor  # [T] on the host: the prompt and every token accepted so far
    config: GenerationConfig
    drafter: Drafter
    policy: KPolicy
    seeds: Seeds  # the sequence's random generators, one per device
    stats: DecodeStats
    guards: Guards | NoGuards = field(default_factory=NoGuards)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # what the batch's window reads
    started: float = field(default_factory=time.perf_counter)

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def draft_settings(self) -> DraftSettings:
        return DraftSettings(self.config.sampling, self.seeds, self.policy.min_confidence)


@dataclass(frozen=True)
class Draft:
    """One row's part of a step before verification."""

    chosen: int  # the k policy's choice
    k: int  # draft tokens requested: the choice within the window and the row's limits (0 on an anchor step)
    proposal: Proposal
    seconds: float
    anchored: bool  # a guard made this a target-only step


@dataclass(frozen=True)
class StepResult:
    new: list[torch.Tensor]  # per row: its accepted drafts and the target's next token, on the host
    drafted: int  # draft tokens proposed over all rows
    draft_s: float  # seconds spent drafting over all rows


@torch.inference_mode()
def speculative_step(target: RowBackend, slots: list[int], rows: list[Row], window: int | None = None) -> StepResult:
    """Advance ``rows`` (held in ``target``'s cache rows ``slots``) by one speculative step; ``window`` caps every row's k."""
    t0 = time.perf_counter()
    drafts = [_draft(row, window, target.max_context) for row in rows]
    t1 = time.perf_counter()
    lengths = [len(d.proposal) for d in drafts]
    feeds = [
        torch.cat([row.tokens[target.lengths[slot] :], d.proposal.tokens])
        for row, slot, d in zip(rows, slots, drafts, strict=True)
    ]
    trees = [d.proposal.parents if d.proposal.is_tree else None for d in drafts]
    for row, tree in zip(rows, trees, strict=True):
        if tree is not None and (row.config.guards.active or row.config.typical_acceptance is not None):
            raise ConfigError(
                "a tree row cannot use guards or typical acceptance (neither is tree-aware): set branches to 1"
            )
    features = [
        getattr(row.drafter, "wants_features", False) for row in rows
    ]  # a drafter that reads the target's hidden states
    extra = {"trees": trees} if any(t is not None for t in trees) else {}
    extra |= {"features": True} if any(features) else {}
    logits = _align(target.forward(slots, feeds, last=max(lengths) + 1, **extra), lengths)
    verdicts = _verify(rows, [d.proposal for d in drafts], trees, logits)
    t2 = time.perf_counter()

    new = []
    for i, (row, slot, d) in enumerate(zip(rows, slots, drafts, strict=True)):
        path, next_token = verdicts[i]
        accepted = len(path)
        # A tree's accepted path moves next to the context in the cache; a chain's is already there.
        target.truncate(slot, row.length + accepted, [row.length + j for j in path] if trees[i] is not None else None)
        if d.k:  # a step without drafts leaves the drafter's state as it was
            row.drafter.accept(accepted)
        if features[i]:  # the hidden states of the positions kept in the cache: the fed context, then the accepted path
            fed, context = target.last_features[i], len(feeds[i]) - lengths[i]
            row.drafter.observe_features(
                torch.cat([fed[:context], fed[context + torch.tensor(path, dtype=torch.long)]])
            )
        tokens = torch.cat([d.proposal.tokens[path], torch.tensor([next_token])])
        scored = (
            logits[i, : accepted + 1] if trees[i] is None else logits[i, [0] + [j + 1 for j in path]]
        )  # along the kept path
        row.tokens = torch.cat([row.tokens, tokens])
        depth = d.proposal.depth  # what a chain reaching as deep would have proposed: acceptance stays per position
        read_prompt = (
            len(feeds[i]) - lengths[i] > 1
        )  # more than the pending token: the step's time is mostly the prompt's
        row.policy.observe(
            StepOutcome(
                depth,
                accepted,
                d.seconds,
                row.length,
                scored,
                tokens,
                lengths[i],
                None if read_prompt else t2 - t1,
                trees[i] is not None,
                d.proposal.draft_steps,
            )
        )
        row.acceptance.observe(depth, accepted)
        row.stats.record_step(
            d.chosen, d.k, lengths[i], accepted, len(tokens), d.seconds, t2 - t1, time.perf_counter() - row.started
        )
        row.stats.events += row.guards.settle(row.stats.new_tokens - len(tokens), accepted, d.anchored)
        if d.anchored:
            row.stats.anchors += 1
            row.drafter.begin(row.draft_settings)  # resynchronise the drafter on the whole context
        new.append(tokens)
    return StepResult(new, sum(lengths), t1 - t0)


def _draft(row: Row, window: int | None, max_context: int) -> Draft:
    chosen = row.policy.choose(row.length)
    limit = min(row.config.max_new_tokens - row.stats.new_tokens, max_context - row.length) - 1
    anchored = row.guards.anchor_due(row.stats.new_tokens)
    if anchored or limit <= 0 or window == 0:
        return Draft(chosen, 0, Proposal.empty(), 0.0, anchored)
    use_tree = getattr(row.policy, "use_tree", None)  # a policy that measures whether trees pay (cost-model)
    branches = row.config.branches if row.config.branches > 1 and (use_tree is None or use_tree()) else 1
    tree_size = getattr(row.policy, "tree_size", None)  # a policy that prices a scored proposal's nodes (cost-model)
    # A tree step of a scoring drafter under a pricing policy asks for the most nodes: their scores (or, for a proposal
    # without scores, the policy's choice) cut them after. Other steps draft what the policy chose.
    scored = branches > 1 and tree_size is not None and getattr(row.drafter, "scored", False)
    wanted = row.config.k if scored else chosen
    k = max(0, min(wanted, limit, wanted if window is None else window))
    if not k:
        return Draft(chosen, 0, Proposal.empty(), 0.0, anchored)
    start = time.perf_counter()
    proposal = row.drafter.propose(row.tokens, k, branches)
    if proposal.scores is not None and tree_size is not None:
        parents = proposal.parents if proposal.parents is not None else torch.arange(-1, len(proposal) - 1)
        proposal = proposal.cut(tree_size(proposal.scores, parents, time.perf_counter() - start, proposal.draft_steps))
    elif wanted != chosen:
        proposal = proposal.cut(chosen)
    if proposal.probs is None:  # a deterministic draft token that a guard blocks would only be rejected
        g0 = time.perf_counter()
        proposal = proposal.cut(row.guards.trim(row.tokens, proposal.tokens))
        row.stats.guard_s += time.perf_counter() - g0
    # The context lives on the host: draft tokens cross once (probabilities stay where they are, for the verifier).
    proposal = replace(proposal, tokens=proposal.tokens.cpu())
    return Draft(chosen, k, proposal, time.perf_counter() - start, anchored)


def _align(logits: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Logits [B, width + 1, V] with position j of row i judging that row's draft j (feeds end in their drafts, so rows with fewer are shifted left)."""
    width = logits.shape[1] - 1
    if all(n == width for n in lengths):
        return logits
    device = logits.device
    shift = torch.tensor([width - n for n in lengths]).to(device)
    columns = (torch.arange(width + 1, device=device)[None, :] + shift[:, None]).clamp(max=width)
    return logits.gather(1, columns[:, :, None].expand(-1, -1, logits.shape[-1]))


def _verify(
    rows: list[Row], proposals: list[Proposal], trees: list[torch.Tensor | None], logits: torch.Tensor
) -> list[tuple[list[int], int]]:
    """(accepted nodes, next token) per row: guards adjust the logits; exact greedy chains are judged together, exact
    greedy trees together, other rows alone. ``trees[i]``: row i's tree (its parents), None for a chain."""
    device = logits.device
    lengths = [len(p) for p in proposals]
    tokens = torch.zeros(len(rows), logits.shape[1] - 1, dtype=torch.long)
    parents = torch.full_like(tokens, -1)
    for i, p in enumerate(proposals):
        if lengths[i]:
            tokens[i, : lengths[i]] = p.tokens
            parents[i, : lengths[i]] = p.parents if p.parents is not None else torch.arange(-1, lengths[i] - 1)
    tokens, parents, counts = tokens.to(device), parents.to(device), torch.tensor(lengths).to(device)
    temperatures = []
    for i, (row, p) in enumerate(zip(rows, proposals, strict=True)):
        g0 = time.perf_counter()
        temperatures.append(row.guards.adjust(row.tokens, p.tokens, logits[i, : lengths[i] + 1]))
        row.stats.guard_s += time.perf_counter() - g0

    exact_greedy = [row.config.sampling.greedy and row.config.typical_acceptance is None for row in rows]
    chains = [i for i, tree in enumerate(trees) if exact_greedy[i] and tree is None]
    greedy_trees = [i for i, tree in enumerate(trees) if exact_greedy[i] and tree is not None]
    out: dict[int, tuple[list[int], int]] = {}
    if chains:
        pick = slice(None) if len(chains) == len(rows) else torch.tensor(chains).to(device)
        verdict = verify(tokens[pick], counts[pick], logits[pick], None, rows[chains[0]].config.sampling)
        out.update((i, (list(range(n)), t)) for i, (n, t) in zip(chains, verdict.on_host().T.tolist(), strict=True))
    if greedy_trees:
        pick = torch.tensor(greedy_trees).to(device)
        verdict = verify_tree_greedy(tokens[pick], parents[pick], counts[pick], logits[pick])
        out.update(zip(greedy_trees, zip(verdict.paths, verdict.next_tokens, strict=True), strict=True))
    for i in range(len(rows)):
        if i in out:
            continue
        config, n, p = rows[i].config, lengths[i], proposals[i]
        rng, temperature = rows[i].seeds.on(device), temperatures[i]
        probs = None if p.probs is None else p.probs.to(device)
        if trees[i] is not None:
            verdict = verify_tree_sampled(
                tokens[i, :n], parents[i, :n], logits[i, : n + 1], probs, config.sampling, rng, temperature
            )
            out[i] = (verdict.paths[0], verdict.next_tokens[0])
            continue
        args = (tokens[i : i + 1, :n], counts[i : i + 1], logits[i : i + 1, : n + 1])
        temperature = None if temperature is None else temperature[None]
        if config.typical_acceptance is not None:
            verdict = typical_verify(*args, config.sampling, config.typical_acceptance, rng, temperature)
        else:
            verdict = verify(*args, None if probs is None else probs[None], config.sampling, rng, temperature)
        accepted, token = verdict.on_host()[:, 0].tolist()
        out[i] = (list(range(accepted)), token)
    return [out[i] for i in range(len(rows))]
