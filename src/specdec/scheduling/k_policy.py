"""How many tokens to draft at each step.

A fixed k is too few on easy text and too many on hard text, and what "too
many" means depends on the runtime: verifying 9 tokens costs little more than one
on a runtime that reads each weight once per step, and several times one on one that
does not. A policy plans each step (k, and for rows that may draft trees, whether this step drafts one and how
many of a scored proposal's nodes to verify) and observes the step's outcome after it; it never sees a model.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.acceptance import AcceptanceEstimate


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What one step did for one row: the record its k policy, stats and acceptance estimate read."""

    chosen: int  # the k policy's choice
    asked: int  # draft tokens asked of the drafter: the choice within the batch's k_cap and the row's limits (0: none)
    depth: int  # nodes on the draft's longest path (a chain's length): what acceptance is judged against
    nodes: int  # draft nodes the target scored (a tree's all; a chain's ``depth``)
    accepted: int  # of those, how many it accepted (a path from the root)
    branched: bool  # the draft was a tree (some node had two children): its forward cost a tree's, not a chain's
    draft_s: float  # seconds spent drafting
    draft_steps: int  # forwards of a drafting model the draft took (Proposal.draft_steps)
    target_s: float  # seconds of the step's target forward and verification (the whole batch's)
    read_prompt: bool  # the row's feed held more than its pending token: ``target_s`` was mostly the prompt's
    anchored: bool  # a guard made this a target-only step
    context_length: int  # tokens in the sequence after the step
    # the target's logits as verified (bias, penalties, guards) [accepted + 1, V] at the new tokens; None after a step
    # that needed only their argmax (Row.argmax_only: nothing read them)
    logits: torch.Tensor | None
    new_tokens: torch.Tensor  # [accepted + 1]

    @property
    def verify_s(self) -> float | None:
        """The target's seconds for a step over drafts alone; None when it also read the prompt."""
        return None if self.read_prompt else self.target_s

    def token_nll(self) -> torch.Tensor:
        """Negative log-likelihood of each new token under the target (computed only when asked: it reads the full
        vocabulary)."""
        if self.logits is None:
            raise ValueError("this step kept no logits: a k policy that reads them declares reads_logits")
        logp = torch.log_softmax(self.logits.float(), dim=-1)
        return -logp.gather(-1, self.new_tokens.to(logp.device)[:, None]).squeeze(-1).cpu()


# How many of a scored proposal's best nodes to verify, from its scores, its parents, the seconds spent drafting it
# and the forwards of a drafting model it took.
NodePrice = Callable[[torch.Tensor, torch.Tensor, float, int], int]


@dataclass(frozen=True)
class KPlan:
    """What a k policy decides before one step of its sequence."""

    k: int  # tokens to draft (0 = a plain target step)
    tree: bool = False  # where asked (a row that may draft trees and drafts this step): a tree, else a chain
    # where the policy prices a scored proposal's nodes: how many to keep (the engine then asks a scoring drafter of a
    # tree step for the most nodes); None: a proposal is cut to k
    price: NodePrice | None = None


class KPolicy(ABC):
    """Plans each step of one sequence (its draft length and, for rows that may draft trees, its shape) and learns
    from what each step did.

    ``plan`` and ``observe`` are the whole contract, with two declared values: ``min_confidence``, which a drafter is
    given when it begins a sequence, before any plan, and ``reads_logits``.
    """

    #: drafters with probabilities stop at the first token below this (0 = never); see the confidence policy
    min_confidence: float = 0.0
    #: whether ``observe`` reads the target's logits (StepOutcome.logits); else a greedy step may skip them
    reads_logits: ClassVar[bool] = False

    @abstractmethod
    def plan(self, context_length: int, trees: bool) -> KPlan:
        """The plan of the step about to be taken; ``trees``: the row may draft a tree now (it asks once per such
        step), so the plan says whether it does."""

    @abstractmethod
    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the step just taken."""


@dataclass
class FixedK(KPolicy):
    """Always the same k: the baseline every adaptive policy is measured against."""

    k: int
    min_confidence: float = 0.0

    def plan(self, context_length: int, trees: bool) -> KPlan:
        return KPlan(self.k, trees)

    def observe(self, outcome: StepOutcome) -> None:
        pass


@dataclass
class HeuristicK(KPolicy):
    """transformers' schedule: k + 2 after a step whose drafts were all accepted, k - 1 otherwise, within [1, max_k]."""

    max_k: int
    k: int | None = None
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        self.k = self.max_k if self.k is None else self.k

    def plan(self, context_length: int, trees: bool) -> KPlan:
        return KPlan(self.k, trees)

    def observe(self, outcome: StepOutcome) -> None:
        if outcome.depth:  # a step where the drafter found nothing says nothing about k
            full = outcome.accepted == outcome.depth
            self.k = max(1, min(self.max_k, self.k + 2 if full else self.k - 1))


@dataclass
class PerplexityK(KPolicy):
    """The seed's rule, from the target's perplexity over the last ``window`` generated tokens.

    Below ``threshold``: k = min(``easy_k``, context // ``easy_divisor``); otherwise
    k = max(``hard_min``, ``hard_budget`` // context); capped at max_k. Before any
    token is generated the text counts as hard. The rule reads only length and
    perplexity, never acceptance: on long contexts the hard branch is stuck at
    hard_min (512 // length is 1 past 256 tokens), on short easy contexts the
    easy branch gives k = 0 (under 10 tokens), and low perplexity does not mean
    the drafter agrees with the target.
    """

    max_k: int
    threshold: float = 50.0
    easy_k: int = 5
    easy_divisor: int = 10
    hard_min: int = 2
    hard_budget: int = 512
    window: int = 32
    min_confidence: float = 0.0
    reads_logits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._nll: deque[float] = deque(maxlen=self.window)

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self._nll) / len(self._nll)) if self._nll else math.inf

    def plan(self, context_length: int, trees: bool) -> KPlan:
        if self.perplexity < self.threshold:
            k = min(self.easy_k, context_length // self.easy_divisor)
        else:
            k = max(self.hard_min, self.hard_budget // max(context_length, 1))
        return KPlan(min(k, self.max_k), trees)

    def observe(self, outcome: StepOutcome) -> None:
        self._nll.extend(outcome.token_nll().tolist())


@dataclass
class ConfidenceK(KPolicy):
    """Draft up to max_k tokens, stopping at the first whose draft probability is below ``threshold``.

    Drafters without probabilities (prompt lookup, cross-tokenizer drafts) draft max_k.
    """

    max_k: int
    threshold: float = 0.5

    @property
    def min_confidence(self) -> float:
        return self.threshold

    def plan(self, context_length: int, trees: bool) -> KPlan:
        return KPlan(self.max_k, trees)

    def observe(self, outcome: StepOutcome) -> None:
        pass


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one target forward over n tokens, measured at a few n; linear in between and beyond."""

    seconds: dict[int, float]

    def __post_init__(self) -> None:
        if not self.seconds or min(self.seconds) != 1:
            raise ValueError("a cost curve needs a measurement at n = 1")

    def __call__(self, n: int) -> float:
        sizes = sorted(self.seconds)
        if n in self.seconds:
            return self.seconds[n]
        below = max((s for s in sizes if s < n), default=sizes[0])
        above = min((s for s in sizes if s > n), default=None)
        if above is None:  # beyond the last measurement: extend the last segment's slope
            if len(sizes) == 1:
                return self.seconds[below] * n
            below, above = sizes[-2], sizes[-1]
        slope = (self.seconds[above] - self.seconds[below]) / (above - below)
        return self.seconds[below] + slope * (n - below)


def expected_tokens(a: float, k: int) -> float:
    """Tokens one step yields in expectation with k drafts accepted at rate a (Leviathan et al.):
    (1 - a^(k+1)) / (1 - a)."""
    a = min(a, 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


TREE_TRIAL_EVERY = 8  # a tree row's steps before the slower way is drafted again; twice as many after each trial it
TREE_TRIAL_MOST = 32  # stays slower, up to this many; TREE_TRIAL_EVERY again as soon as the ways swap
RATE_DECAY = 0.8  # weight of the past in the tree and chain steps' rates


class WayRates:
    """Tokens per second of tree steps and of chain steps (decayed sums of tokens and seconds), and the steps counted:
    one tree row's, or shared by a generator's timed rows so that a row starts from what earlier ones measured."""

    def __init__(self) -> None:
        self.rates: dict[bool, tuple[float, float] | None] = {True: None, False: None}  # tree (True) and chain steps
        self.steps = 0  # since the last trial of the slower way, or since the ways swapped
        self.interval = TREE_TRIAL_EVERY  # steps between trials
        self._faster: bool | None = None  # the faster way at the last step
        self._lock = threading.Lock()  # rows of concurrent runs share it

    def next_is_tree(self) -> bool:
        """Whether the next step drafts a tree: a tree, then a chain, until both ways have a rate; then the faster way,
        and the slower one after ``interval`` steps (a trial keeps its rate current). Each trial doubles the interval,
        up to TREE_TRIAL_MOST, so a way that keeps losing costs ever fewer steps; when the ways swap it is
        TREE_TRIAL_EVERY again."""
        with self._lock:
            self.steps += 1
            tree, chain = self.rates[True], self.rates[False]
            if tree is None or chain is None:
                return tree is None
            faster = tree[0] / tree[1] >= chain[0] / chain[1]
            if self._faster is not None and faster != self._faster:
                self.steps, self.interval = 0, TREE_TRIAL_EVERY
            self._faster = faster
            if self.steps < self.interval:
                return faster
            self.steps, self.interval = 0, min(2 * self.interval, TREE_TRIAL_MOST)
            return not faster

    def record(self, tree: bool, tokens: int, seconds: float) -> None:
        with self._lock:
            past_tokens, past_seconds = self.rates[tree] or (0.0, 0.0)
            self.rates[tree] = (RATE_DECAY * past_tokens + tokens, RATE_DECAY * past_seconds + seconds)


class CostModelK(KPolicy):
    """Pick the k that maximises expected tokens per second under this machine's costs.

    The acceptance rate is estimated online (AcceptanceEstimate); a step with k
    drafts yields expected_tokens(a, k) and costs a target forward over k + 1
    tokens plus k draft steps. A draft step's cost is ``draft_s_per_token``
    when given (then k depends only on the costs and the tokens, so a seeded
    run repeats itself), otherwise learned from the measured drafting time.
    A tree of drafts costs its forward's ``tree_overhead`` (seconds over a
    chain as long, by tokens; none when not given) on top of the chain's price.
    ``ways``: a tree row's rates of tree and chain steps, when shared with other rows (its own otherwise).
    ``tree_draft_s_per_step``: a seeded run's price of a level of a tree's drafting (default: a chain step's).
    Its plans price a scored proposal's nodes (``tree_size``) and choose between trees and chains by their measured
    rates (``choose_tree``).
    """

    def __init__(
        self,
        max_k: int,
        costs: CostCurve,
        decay: float = 0.9,
        prior: float = 0.8,
        prior_weight: float = 1.0,
        draft_s_per_token: float | None = None,
        tree_overhead: CostCurve | None = None,
        ways: WayRates | None = None,
        tree_draft_s_per_step: float | None = None,
    ) -> None:
        self.max_k = max_k
        self._verify_s = [costs(k + 1) for k in range(max_k + 1)]  # the curve is fixed: price each k once
        extra = [tree_overhead(k + 1) if tree_overhead is not None and k >= 2 else 0.0 for k in range(max_k + 1)]
        # k nodes as a tree
        self._tree_verify_s = [chain + more for chain, more in zip(self._verify_s, extra, strict=True)]
        self.estimate = AcceptanceEstimate(decay, prior, prior_weight)
        self._learn_draft_cost = draft_s_per_token is None
        self._draft_s_per_token = draft_s_per_token or 0.0
        self._tree_draft_s_per_step = (
            self._draft_s_per_token if tree_draft_s_per_step is None else tree_draft_s_per_step
        )
        self._chosen = 0
        self.min_confidence = 0.0
        # accepted nodes over the drafter's summed scores of the nodes verified: how far to trust its scores
        self.calibration = 1.0
        self._predicted: float | None = None
        self.ways = ways or WayRates()
        self._drafting_tree: bool | None = None  # what this step of a tree row drafts; None: not asked

    @property
    def acceptance(self) -> float:
        return self.estimate.value

    def tree_size(self, scores: torch.Tensor, parents: torch.Tensor, draft_s: float, steps: int) -> int:
        """How many of a scored proposal's best nodes (``parents``: its tree, drafted in ``steps`` forwards of a model)
        to verify (EAGLE-2's reranking, priced by this machine's costs): its plans' ``price``.

        A node's score is the drafter's chance that it is accepted, so the best n nodes are expected to yield
        1 + calibration * (their summed scores) tokens for a forward over n + 1 positions (a tree's price once they
        branch, a chain's before) plus the drafting already done; the n with the most tokens per second wins.
        """
        if not self._learn_draft_cost:  # a seeded run: the priced draft cost, not the clock, so the cut repeats
            draft_s = steps * self._step_price(bool(self._drafting_tree))
        gains = torch.cat([torch.zeros(1), scores.float().cpu().cumsum(0)])[: self.max_k + 1]
        n = len(gains)
        chain = torch.cat(
            [torch.ones(1, dtype=torch.bool), (parents.cpu()[: n - 1] == torch.arange(-1, n - 2)).cummin(0).values]
        )
        verify = torch.where(chain, torch.tensor(self._verify_s[:n]), torch.tensor(self._tree_verify_s[:n]))
        rates = (1 + self.calibration * gains) / (verify + draft_s)
        best = int(rates.argmax())
        self._predicted = float(gains[best])
        return best

    def _step_price(self, tree: bool) -> float:
        """A seeded run's price of one draft step: a level of a tree's, or a chain's token."""
        return self._tree_draft_s_per_step if tree else self._draft_s_per_token

    def choose_tree(self) -> bool:
        """Whether this step of a row allowed trees drafts one (else a chain, drafted as a chain row would); asked by
        ``plan`` where the row may draft a tree.

        A tree verifies more nodes for more accepted tokens and costs more to draft; whether that pays depends on the
        drafter, the text and the machine, so it is measured: each way's tokens per second (drafting and verification
        timed; in a seeded run priced by this machine's cost curves, a tree's with its overhead), the faster way
        drafted, the other on trial steps, ever rarer while it stays slower (WayRates). Rows without rates try a tree
        first, then a chain; a timed row starts from its generator's earlier rows' rates (Generator.k_policy). So a tree
        row is slower than a chain row by its trial steps at most.
        """
        self._drafting_tree = self.ways.next_is_tree()
        return self._drafting_tree

    def expected_rate(self, k: int, a: float | None = None) -> float:
        """Expected tokens per second of a step drafting k tokens (at acceptance ``a``, by default the estimate)."""
        tokens = expected_tokens(self.acceptance if a is None else a, k)
        return tokens / (self._verify_s[k] + k * self._draft_s_per_token)

    def choose(self) -> int:
        """The k with the most expected tokens per second at the current acceptance estimate."""
        a = self.acceptance
        self._chosen = max(range(self.max_k + 1), key=lambda k: self.expected_rate(k, a))
        return self._chosen

    def plan(self, context_length: int, trees: bool) -> KPlan:
        return KPlan(self.choose(), trees and self.choose_tree(), self.tree_size)

    def observe(self, outcome: StepOutcome) -> None:
        tree = self._drafting_tree  # None: a chain row; False: a tree row's chain step
        self._drafting_tree = None
        if tree is not None:
            # Timed, where the clock may be read; a seeded run prices both ways, so it repeats: the draft's steps
            # (forwards of its model: one per level of a tree, as per token of a chain; none for a copy), a forward over
            # the nodes (a tree's with its overhead).
            n = min(outcome.nodes, self.max_k)
            steps = outcome.draft_steps
            draft_s = outcome.draft_s if self._learn_draft_cost else steps * self._step_price(tree)
            priced = (self._tree_verify_s if outcome.branched else self._verify_s)[n]
            verify_s = outcome.verify_s if self._learn_draft_cost and outcome.verify_s is not None else priced
            self.ways.record(tree, outcome.accepted + 1, draft_s + verify_s)
        # the scores' calibration, bounded so that one surprise cannot switch trees off or blow them up
        if self._predicted:
            ratio = outcome.accepted / self._predicted
            self.calibration = min(3.0, max(0.2, self.calibration + 0.2 * (ratio - self.calibration)))
        self._predicted = None
        # A tree accepts more and drafts more nodes than the chain k is chosen for: its step says nothing of either. A
        # tree step whose drafts did not branch was a chain, so it teaches the acceptance (not the draft cost: it may
        # draft more than k).
        if tree and outcome.branched:
            return
        self.estimate.observe(outcome.depth, outcome.accepted)
        if self._chosen and self._learn_draft_cost and not tree:
            per_token = outcome.draft_s / self._chosen
            self._draft_s_per_token += 0.5 * (per_token - self._draft_s_per_token)
