"""The speculative step's phases, each called on hand-built rows: plan, draft, score, verify, commit (engine/step.py),
a tree row's (engine/trees.py) and the verifiers' dispatch (verification/verifiers.py).

A scripted target stands for the model: for each row it returns logits whose argmax at each judged position is the
token the test names, so accepted, recovered and bonus tokens are known beforehand.
"""

from __future__ import annotations

import pytest
import torch

from specdec.config import GenerationConfig, SamplingConfig, TypicalAcceptance
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.engine.stats import DecodeStats
from specdec.engine.step import (
    CHAINS,
    DraftPlan,
    Row,
    RowStep,
    Shape,
    commit,
    draft,
    score,
    speculative_step,
    verify_rows,
)
from specdec.engine.trees import TREES
from specdec.errors import ConfigError
from specdec.guards import NoGuards
from specdec.models.backend import BackendCapabilities, ModelInfo, RowBackend
from specdec.scheduling import FixedK, KPlan, KPolicy, StepOutcome
from specdec.seeds import Seeds
from specdec.verification import Drafts, Kind, RowDrafts, Rule, judge

V = 16  # vocabulary
PROMPT = [1, 2, 3]
PEAK = 60.0  # a logit this far above the rest: the target's distribution is (numerically) one-hot


def peaked(tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] whose argmax (and, sampled, whose draw) at position j is tokens[j]."""
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = PEAK
    return logits


class ScriptedTarget(RowBackend):
    """Rows whose forward returns, for each fed row, ``script[row_id]`` peaked (its last positions right-aligned), and
    that record every truncation."""

    info = ModelInfo(
        "scripted", vocab_size=V, max_context=64, capabilities=BackendCapabilities(trees=True), torch_threads=False
    )

    def __init__(self, rows: int) -> None:
        self.cached_lengths = [0] * rows
        self.last_features = []
        self.script: dict[int, list[int]] = {}
        self.fed: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor | None] | None]] = []
        self.truncated: list[tuple[int, int, list[int] | None]] = []

    def add_rows(self, count: int) -> None:
        self.cached_lengths += [0] * count

    def remove_rows(self, row_ids: list[int]) -> None:
        raise NotImplementedError

    def forward(self, row_ids, feeds, last, trees=None, features=False) -> torch.Tensor:
        self.fed.append((row_ids, feeds, trees))
        logits = torch.zeros(len(row_ids), last, V)
        for i, (row_id, feed) in enumerate(zip(row_ids, feeds, strict=True)):
            self.cached_lengths[row_id] += len(feed)
            judged = self.script[row_id]
            logits[i, last - len(judged) :] = peaked(judged)
        return logits

    def truncate(self, row_id: int, length: int, branch: list[int] | None = None) -> None:
        self.truncated.append((row_id, length, branch))
        self.cached_lengths[row_id] = length


class ScriptedDrafter(Drafter):
    """Proposes what the test hands it and records what it is asked and told."""

    capabilities = DrafterCapabilities(trees=True, scores=True)

    def __init__(self, proposal: Proposal) -> None:
        self.proposal = proposal
        self.asked: list[tuple[int, int]] = []
        self.accepted: list[int] = []

    def begin(self, settings: DraftSettings) -> None:
        pass

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        self.asked.append((k, branches))
        return self.proposal

    def accept(self, n: int) -> None:
        self.accepted.append(n)

    def fork(self) -> Drafter:
        return self


class Anchoring(NoGuards):
    """Guards whose every step is a target-only anchor step."""

    def anchor_due(self, new_tokens: int) -> bool:
        return True


class Pricing(FixedK):
    """A k policy whose plans price scored nodes (keeping ``keep`` of them) and draft a tree wherever asked."""

    def __init__(self, k: int, keep: int) -> None:
        super().__init__(k)
        self.keep = keep

    def plan(self, context_length: int, trees: bool) -> KPlan:
        return KPlan(self.k, trees, self.price)

    def price(self, scores: torch.Tensor, parents: torch.Tensor, draft_s: float, steps: int) -> int:
        return self.keep


def make_row(
    drafts: list[int] | Proposal = (),
    *,
    k: int = 4,
    policy: KPolicy | None = None,
    temperature: float = 0.0,
    branches: int = 1,
    max_new_tokens: int = 32,
    **config,
) -> Row:
    proposal = drafts if isinstance(drafts, Proposal) else Proposal(torch.tensor(list(drafts), dtype=torch.long))
    sampling = SamplingConfig(temperature=temperature)
    settings = GenerationConfig(
        k=k, k_policy="fixed", branches=branches, max_new_tokens=max_new_tokens, sampling=sampling, **config
    )
    shape = TREES if branches > 1 else CHAINS
    return Row(
        torch.tensor(PROMPT),
        settings,
        ScriptedDrafter(proposal),
        policy or FixedK(k),
        Seeds(0),
        DecodeStats(),
        prompt_length=len(PROMPT),
        shape=shape,
    )


def drafted_step(row: Row, row_id: int = 0) -> RowStep:
    """The row's step after phase 1, its plan and proposal (its cache is taken to hold the prompt)."""
    step = RowStep(row=row, row_id=row_id, plan=row.plan(None, 64))
    draft(step)
    return step


def drafted(row: Row, draft_plan: DraftPlan) -> tuple[Proposal, Shape]:
    """Phase 1's proposal and its shape under ``draft_plan``."""
    step = RowStep(row=row, row_id=0, plan=draft_plan)
    draft(step)
    return step.proposal, step.shape


# Phase 1: plan and draft.


def test_the_plan_is_the_choice_within_the_k_cap_and_the_room_left() -> None:
    assert make_row(k=4).plan(None, 64) == DraftPlan(chosen=4, asked=4)
    assert make_row(k=4).plan(2, 64) == DraftPlan(chosen=4, asked=2)  # the batch's k_cap caps it
    assert make_row(k=4, max_new_tokens=3).plan(None, 64) == DraftPlan(chosen=4, asked=2)  # one token is the target's
    assert make_row(k=4).plan(None, len(PROMPT) + 1) == DraftPlan(chosen=4)  # the context is full but for that one
    assert make_row(k=4).plan(0, 64) == DraftPlan(chosen=4)
    row = make_row(k=4)
    row.guards = Anchoring()
    assert row.plan(None, 64) == DraftPlan(chosen=4, anchored=True)


def test_a_proposal_is_cut_to_the_choice_and_its_tokens_brought_to_the_host() -> None:
    row = make_row([5, 6, 7, 8, 9, 10], k=3)
    proposal, shape = drafted(row, DraftPlan(chosen=3, asked=3))
    assert proposal.tokens.tolist() == [5, 6, 7] and shape is CHAINS
    assert row.drafter.asked == [(3, 1)]


def test_a_scored_proposal_is_cut_where_its_policy_prices_nodes() -> None:
    """A scored chain too: the policy's price decides how many of its nodes the target judges."""
    scored = Proposal(torch.tensor([5, 6, 7, 8]), scores=torch.tensor([0.9, 0.8, 0.5, 0.1]))
    row = make_row(scored, k=4, policy=Pricing(4, keep=2))
    proposal, _ = drafted(row, row.plan(None, 64))
    assert proposal.tokens.tolist() == [5, 6]


def test_a_chain_rows_unasked_tree_is_judged_as_a_tree() -> None:
    tree = Proposal(torch.tensor([5, 6]), parents=torch.tensor([-1, -1]))
    _, shape = drafted(make_row(tree), DraftPlan(chosen=2, asked=2))
    assert shape is TREES


# Phase 2: score.


def test_every_row_is_fed_its_missing_context_then_its_drafts_in_one_forward() -> None:
    target = ScriptedTarget(2)
    target.cached_lengths[1] = len(PROMPT) - 1  # row 1 has run before: only its pending token is missing
    steps = [drafted_step(make_row([5, 6, 7], k=3)), drafted_step(make_row([8], k=1), row_id=1)]
    target.script = {0: [5, 6, 7, 9], 1: [8, 4]}
    logits = score(target, steps)
    ((row_ids, feeds, trees),) = target.fed
    assert row_ids == [0, 1] and trees == [None, None]
    assert [feed.tolist() for feed in feeds] == [PROMPT + [5, 6, 7], [3, 8]]
    assert [step.uncached for step in steps] == [3, 1]
    assert logits.shape == (2, 4, V)
    assert logits[1, :2].argmax(-1).tolist() == [8, 4]  # aligned: column j judges the row's draft j


# Phase 3: verify.


def scored(target: ScriptedTarget, steps: list[RowStep], judged: list[list[int]]) -> torch.Tensor:
    target.script = dict(enumerate(judged))
    return score(target, steps)


def test_greedy_chains_accepted_recovered_and_bonus_tokens() -> None:
    """All drafts accepted (then the bonus token), the first rejected (the recovered token in its place), a prefix
    accepted, no drafts at all: the same verdicts, judged together."""
    steps = [drafted_step(make_row([5, 6, 7], k=3)) for _ in range(3)] + [drafted_step(make_row([], k=3))]
    for i, step in enumerate(steps):
        step.row_id = i
    logits = scored(ScriptedTarget(4), steps, [[5, 6, 7, 9], [4, 6, 7, 9], [5, 4, 7, 9], [11]])
    verify_rows(steps, logits)
    assert [(step.path, step.next_token) for step in steps] == [([0, 1, 2], 9), ([], 4), ([0], 4), ([], 11)]


def test_sampled_chains_accept_drafts_drawn_from_the_target_law() -> None:
    """A draft reporting q = p is accepted whatever the uniform; one the target gives no probability is rejected and
    the recovered token drawn from the residual, here the target's own token."""
    p = torch.softmax(peaked([5, 6, 9]), -1)
    agreeing = drafted_step(make_row(Proposal(torch.tensor([5, 6]), p[:2]), k=2, temperature=1.0))
    q = torch.softmax(peaked([7, 8]), -1)
    opposed = drafted_step(make_row(Proposal(torch.tensor([7, 8]), q), k=2, temperature=1.0), row_id=1)
    logits = scored(ScriptedTarget(2), [agreeing, opposed], [[5, 6, 9], [5, 6, 9]])
    verify_rows([agreeing, opposed], logits)
    assert (agreeing.path, agreeing.next_token) == ([0, 1], 9)
    assert (opposed.path, opposed.next_token) == ([], 5)


def test_the_dispatch_judges_each_kind_by_its_verifier() -> None:
    """A greedy chain, a greedy tree and a typical chain in one batch: each row's verdict is its kind's."""
    greedy, typical = SamplingConfig(), TypicalAcceptance()
    tokens = torch.tensor([[5, 6], [5, 7], [5, 6]])
    parents = torch.tensor([[-1, 0], [-1, -1], [-1, 0]])
    logits = torch.stack([peaked([5, 6, 9]), peaked([7, 3, 9]), peaked([5, 4, 9])])
    rows = [
        RowDrafts(Kind(Rule.GREEDY, tree=False), 2, greedy, None, None, None, None),
        RowDrafts(Kind(Rule.GREEDY, tree=True), 2, greedy, None, None, None, None),
        RowDrafts(Kind(Rule.TYPICAL, tree=False), 2, greedy, typical, None, None, None),
    ]
    verdicts = judge(Drafts(tokens, parents, torch.tensor([2, 2, 2]), logits, rows))
    assert verdicts == [([0, 1], 9), ([1], 9), ([0], 4)]
    assert Rule.of(SamplingConfig(temperature=0.7), None) is Rule.SAMPLED
    assert Rule.of(SamplingConfig(temperature=0.7), typical) is Rule.TYPICAL


class ArgmaxTarget(ScriptedTarget):
    """A scripted target that also gives each position's argmax alone, and records which of the two it was asked."""

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.asked: list[str] = []

    def forward(self, row_ids, feeds, last, trees=None, features=False) -> torch.Tensor:
        self.asked.append("logits")
        return super().forward(row_ids, feeds, last, trees, features)

    def forward_argmax(self, row_ids, feeds, last, trees=None, features=False) -> torch.Tensor:
        self.asked.append("argmax")
        return super().forward(row_ids, feeds, last, trees, features).max(dim=-1).indices


def test_greedy_rows_whose_logits_nothing_reshapes_are_judged_from_the_argmaxes_alone() -> None:
    """A batch of plain greedy rows asks the target for argmaxes only (no logits written; none kept in the outcome),
    with the verdicts the logits give; one row that reads its logits (logprobs) makes the batch ask for logits."""
    judged = [[5, 6, 7, 9], [4, 6, 7, 9], [5, 4, 7, 9]]
    verdicts = {}
    for reader in (False, True):
        target = ArgmaxTarget(3)
        target.script = dict(enumerate(judged))
        rows = [make_row([5, 6, 7], k=3) for _ in range(2)] + [make_row([5, 6, 7], k=3, logprobs=1 if reader else None)]
        outcomes = speculative_step(target, [0, 1, 2], rows)
        assert target.asked == ["logits" if reader else "argmax"]
        assert all((outcome.logits is None) is not reader for outcome in outcomes)
        verdicts[reader] = [row.tokens[len(PROMPT) :].tolist() for row in rows]
    assert verdicts[False] == verdicts[True] == [[5, 6, 7, 9], [4], [5, 4]]


def test_a_row_needs_its_logits_when_anything_reshapes_or_reads_them() -> None:
    from specdec.config import GuardConfig
    from specdec.grammar import Constraint
    from specdec.guards import Guards
    from specdec.scheduling.k_policy import PerplexityK

    assert make_row().argmax_only
    assert not make_row(temperature=0.7).argmax_only  # sampled: the whole law
    assert not make_row(logprobs=0).argmax_only
    biased = make_row()
    biased.config = GenerationConfig(k=4, sampling=SamplingConfig(frequency_penalty=0.5))
    assert not biased.argmax_only
    assert not make_row(typical_acceptance=TypicalAcceptance()).argmax_only
    assert not make_row(policy=PerplexityK(max_k=4)).argmax_only
    guarded = make_row()
    guarded.guards = Guards(GuardConfig(repetition=True), len(PROMPT))
    assert not guarded.argmax_only
    guarded.guards = Guards(GuardConfig(), len(PROMPT))  # guards that leave the logits alone
    assert guarded.argmax_only
    guarded.constraint = Constraint.__new__(Constraint)  # a grammar masks them
    assert not guarded.argmax_only


# Phase 4: commit.


def test_commit_trims_the_cache_to_the_accepted_drafts_and_the_row_observes() -> None:
    target = ScriptedTarget(1)
    row = make_row([5, 6, 7], k=3)
    step = drafted_step(row)
    logits = scored(target, [step], [[5, 4, 7, 9]])
    verify_rows([step], logits)
    outcome = commit(target, step, logits[0], None, 0.5)
    assert target.truncated == [(0, len(PROMPT) + 1, None)]  # the prompt and the one accepted draft
    assert row.tokens.tolist() == PROMPT + [5, 4]
    assert row.drafter.accepted == [1]
    assert (outcome.chosen, outcome.asked, outcome.nodes, outcome.accepted) == (3, 3, 3, 1)
    assert outcome.new_tokens.tolist() == [5, 4] and outcome.logits.argmax(-1).tolist() == [5, 4]
    assert not outcome.branched and outcome.read_prompt and outcome.target_s == 0.5
    assert row.stats.new_tokens == 2 and row.stats.accepted_per_step == [1]


def test_a_step_without_drafts_leaves_the_drafter_alone() -> None:
    target = ScriptedTarget(1)
    row = make_row([5, 6], k=2)
    row.guards = Anchoring()
    target.script = {0: [8]}
    (outcome,) = speculative_step(target, [0], [row])
    assert outcome.anchored and outcome.asked == 0 and outcome.new_tokens.tolist() == [8]
    assert row.drafter.asked == [] and row.drafter.accepted == []


def test_one_step_end_to_end() -> None:
    target = ScriptedTarget(1)
    row = make_row([5, 6, 7], k=3)
    target.script = {0: [5, 6, 7, 9]}
    (outcome,) = speculative_step(target, [0], [row])
    assert row.tokens.tolist() == PROMPT + [5, 6, 7, 9]
    assert target.cached_lengths == [len(PROMPT) + 3]  # every token but the pending one
    assert outcome.accepted == 3 and outcome.draft_s >= 0.0


# A tree row (engine/trees.py).

TREE = Proposal(torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, -1, 1, 1]))  # 5 | 6 -> (7 | 8)


def test_a_tree_row_plans_a_tree_and_a_priced_one_asks_for_k() -> None:
    assert make_row(TREE, k=4, branches=3).plan(None, 64) == DraftPlan(chosen=4, asked=4, branches=3)
    pricing = Pricing(2, keep=3)
    priced = make_row(TREE, k=6, branches=3, policy=pricing)
    assert priced.plan(None, 64) == DraftPlan(chosen=2, asked=6, branches=3, price=pricing.price)

    class ChainsOnly(FixedK):
        def plan(self, context_length: int, trees: bool) -> KPlan:
            return KPlan(self.k)

    assert make_row(TREE, k=4, branches=3, policy=ChainsOnly(4)).plan(None, 64) == DraftPlan(chosen=4, asked=4)


def test_a_tree_step_is_scored_judged_and_kept_along_its_path() -> None:
    target = ScriptedTarget(1)
    row = make_row(TREE, k=4, branches=3)
    step = drafted_step(row)
    assert step.shape is TREES
    # Column 0 judges the root's children, column j + 1 node j's: the target takes 6 (node 1), 8 (node 3), then 11.
    logits = scored(target, [step], [[6, 0, 8, 0, 11]])
    assert target.fed[0][2][0].tolist() == [-1, -1, 1, 1]  # the target read the drafts as the tree
    verify_rows([step], logits)
    assert (step.path, step.next_token) == ([1, 3], 11)
    outcome = commit(target, step, logits[0], None, 0.0)
    n = len(PROMPT)
    assert target.truncated == [(0, n + 2, [n + 1, n + 3])]  # the path moves next to the context
    assert row.tokens.tolist() == PROMPT + [6, 8, 11]
    assert outcome.branched and outcome.logits.argmax(-1).tolist() == [6, 8, 11]


def test_a_tree_row_keeps_a_chain_as_a_chain_and_refuses_a_tree_with_guards() -> None:
    chain = Proposal(torch.tensor([5, 6]), parents=torch.tensor([-1, 0]))
    row = make_row(chain, k=2, branches=3)
    assert TREES.drafted(row, chain) is CHAINS and TREES.drafted(row, TREE) is TREES
    row.config = GenerationConfig(k=2, typical_acceptance=TypicalAcceptance())
    with pytest.raises(ConfigError, match="tree row cannot use guards or typical acceptance"):
        TREES.drafted(row, TREE)


def test_a_tree_s_uniforms_are_keyed_by_depth_and_sibling_rank() -> None:
    """A chain keyed as a tree gets a chain's uniforms; siblings share their level's draw, not their acceptance test."""
    row, device = make_row(k=4), torch.device("cpu")
    chain = Proposal(torch.tensor([5, 6, 7]), parents=torch.tensor([-1, 0, 1]))
    as_tree, as_chain = TREES.uniforms(row, chain, device), CHAINS.uniforms(row, chain, device)
    assert torch.equal(as_tree.sample, as_chain.sample) and torch.equal(as_tree.accept, as_chain.accept)
    tree = TREES.uniforms(row, TREE, device)
    assert tree.sample.shape == (5,) and tree.accept.shape == (4,)
    assert tree.accept[0] != tree.accept[1]  # two roots: rank 0 and rank 1 at one position
    assert tree.accept[0] == as_chain.accept[0] and tree.accept[2] == as_chain.accept[1]  # first children: rank 0
    assert torch.equal(tree.sample[:4], as_chain.sample)  # one draw per level


def test_step_outcomes_are_what_the_policy_reads() -> None:
    target = ScriptedTarget(1)
    seen: list[StepOutcome] = []

    class Watching(FixedK):
        def observe(self, outcome: StepOutcome) -> None:
            seen.append(outcome)

    row = make_row([5, 6], k=2, policy=Watching(2))
    target.script = {0: [5, 9, 9]}
    (outcome,) = speculative_step(target, [0], [row])
    assert seen == [outcome] and outcome.accepted == 1 and row.stats.steps == 1
