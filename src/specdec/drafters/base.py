"""The drafter contract: propose candidate tokens; learn how many were accepted.

A drafter is told once, when a sequence begins, how that sequence samples
(:class:`DraftSettings`); each step it is asked for up to k tokens after the
context and then told how many the target accepted. That is all the engine
needs, so new drafters plug in without touching the decode step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum

import torch

from specdec.config import SamplingConfig
from specdec.models.backend import Backend
from specdec.seeds import Seeds


class Sharing(Enum):
    """Whose history of earlier outputs a drafter that learns across sequences (suffix) may read and feed."""

    EVERYONE = "everyone"  # one history, shared by every sequence
    OWN = "own"  # none: the sequence drafts from itself only, and its output is not kept
    GROUP = "group"  # the sequences of one named group (one API key's)


@dataclass(frozen=True)
class HistoryScope:
    """A sequence's suffix scope: how it shares history (``sharing``) and, for a group, the group's name."""

    sharing: Sharing = Sharing.EVERYONE
    group: str = ""  # the group's name, set exactly when ``sharing`` is GROUP

    def __post_init__(self) -> None:
        if (self.sharing is Sharing.GROUP) != bool(self.group):
            raise ValueError(f"a group's scope needs a group name, and only it has one: {self}")

    @classmethod
    def of_group(cls, name: str) -> HistoryScope:
        """The scope shared by the sequences of the group ``name``."""
        return cls(Sharing.GROUP, name)

    @property
    def history(self) -> str | None:
        """The name of the history it reads and feeds in a store ("" everyone's), None where it shares none."""
        return None if self.sharing is Sharing.OWN else self.group


EVERYONE = HistoryScope()
OWN = HistoryScope(Sharing.OWN)


@dataclass(frozen=True)
class DraftSettings:
    """What stays fixed for one sequence: how it samples, its random generators, and the confidence floor of its k
    policy. (The shape of a step's draft, chain or tree, is asked for with each proposal: the cost model may switch it
    per step.)"""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # a draft token for position t is drawn on device d with ``draft_uniform(seeds, d, t)`` (seeds.py); None: unseeded
    seeds: Seeds | None = None
    min_confidence: float = 0.0  # a drafter with probabilities stops before its first token below this
    scope: HistoryScope = EVERYONE  # whose history a drafter that learns across sequences (suffix) may share


@dataclass(frozen=True)
class Proposal:
    """Candidate tokens for one sequence.

    ``probs`` holds the shaped distribution each token was drawn from, needed for
    exact rejection sampling; None means the drafter is deterministic (its
    distribution is one-hot on the proposed token), and in greedy mode.
    Its tensors may live on the drafter's device; the engine moves them to the target's.

    A tree (``parents`` set) lists its nodes parents first: node i follows node
    ``parents[i]``, or the context when that is -1. Deterministic siblings carry
    distinct tokens; with ``probs``, node i was drawn from ``probs[i]``, the
    draft's distribution after its parent, and siblings are independent draws
    from it (with replacement: they may repeat a token).
    ``parents`` None is a chain (node i follows node i - 1). With ``scores``, the
    nodes are listed best first (a parent scores at least its children), so the
    engine may keep the best few (``cut``) when its costs say so; a tree of drawn
    siblings cannot have scores (refused at construction: keeping the best-scored
    draws would bias the sampled law), a deterministic one can.
    ``steps``: forwards of a drafting model the proposal took, what a seeded run prices its drafting by; None: one per
    level (its depth), as a draft model's chain; 0 for drafters that run no model.
    """

    tokens: torch.Tensor  # [n] long
    probs: torch.Tensor | None = None  # [n, V] float
    parents: torch.Tensor | None = None  # [n] long, each < its own index; None: a chain
    # [n] float: the drafter's estimate that each node is accepted, nodes listed best first
    scores: torch.Tensor | None = None
    steps: int | None = None  # forwards of a drafting model it took; None: its depth

    def __post_init__(self) -> None:
        if self.probs is not None and self.scores is not None and self.is_tree:
            raise ValueError(
                "a tree of drawn siblings (probs) cannot carry scores: cutting or ordering drawn siblings by score "
                "biases the sampled law; report the scores without probs (nodes judged as one-hot) or drop the scores"
            )

    @property
    def draft_steps(self) -> int:
        """Forwards of a drafting model this proposal took (``steps``, by default one per level)."""
        return self.depth if self.steps is None else self.steps

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def links(self) -> torch.Tensor:
        """[n] each node's parent: the tree's ``parents``, or a chain's i - 1."""
        return self.parents if self.parents is not None else torch.arange(-1, len(self) - 1)

    @property
    def is_tree(self) -> bool:
        """More than one node follows some node (a chain written with ``parents`` is not a tree)."""
        return self.parents is not None and bool((self.parents != torch.arange(-1, len(self) - 1)).any())

    @property
    def depth(self) -> int:
        """Nodes on the longest path (a chain's length)."""
        if self.parents is None:
            return len(self)
        depths: list[int] = []
        for parent in self.parents.tolist():
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
        return max(depths, default=0)

    def cut(self, length: int) -> Proposal:
        """The first ``length`` nodes (for a tree: those nearest the root first, as listed); the drafting they took
        stays."""
        if length >= len(self):
            return self
        kept = (None if t is None else t[:length] for t in (self.tokens, self.probs, self.parents, self.scores))
        return Proposal(*kept, self.draft_steps)  # type: ignore[arg-type]

    @staticmethod
    def empty() -> Proposal:
        return Proposal(torch.zeros(0, dtype=torch.long), steps=0)

    @staticmethod
    def tree(branches: list[list[int]], budget: int, steps: int | None = None) -> Proposal:
        """A deterministic tree merging the token runs ``branches`` (best first; shared prefixes become one path), at
        most ``budget`` nodes, drafted in ``steps`` forwards of a model (None: one per level).

        Nodes are listed branch by branch, so the best branch comes whole before the others add their nodes.
        """
        trie = TokenTrie()
        for branch in branches:
            parent = -1
            for token in branch:
                node = trie.find(parent, token)
                if node is None:
                    if len(trie) == budget:
                        break
                    node = trie.add(parent, token)
                parent = node
        return Proposal(
            torch.tensor(trie.tokens, dtype=torch.long), None, torch.tensor(trie.parents, dtype=torch.long), steps=steps
        )


class TokenTrie:
    """Tree nodes keyed by (parent node, token): the same token after the same path is one node. Nodes are numbered in
    the order they are added, so parents come before their children, as a tree ``Proposal`` lists them."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}
        self.tokens: list[int] = []
        self.parents: list[int] = []  # -1: the node follows the context

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, parent: int, token: int) -> int | None:
        return self._nodes.get((parent, token))

    def add(self, parent: int, token: int) -> int:
        node = self._nodes[(parent, token)] = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        return node


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a drafter does beyond proposing chains. The engine reads this record, never the drafter's other
    attributes."""

    trees: bool = False  # honours ``branches`` > 1 (a chain-only drafter is always asked for chains)
    scores: bool = False  # its tree proposals carry ``scores``: the engine asks for the most nodes and keeps the best
    features: bool = False  # reads the target's final hidden states: ``observe_features`` after every step
    measures_steps: bool = False  # runs a model outside a Backend: ``measure_step`` prices one of its draft steps
    learns: bool = False  # keeps what ended sequences taught it (``finish``): later sequences draft from earlier ones


class Drafter(ABC):
    """Proposes up to k next tokens for the current context of one sequence.

    Every member the engine uses is declared here. A new drafter implements ``begin``, ``propose`` and ``fork``,
    overrides ``accept`` if it keeps per-step state, and declares in ``capabilities`` what more it does; the methods a
    capability names (``observe_features``, ``measure_step``) are called only when it is declared.
    """

    #: logits width for model drafters (checked against the target's); None for vocabulary-free drafters
    vocab_size: int | None = None
    #: the model that drafts, None for model-free drafters; its one-token cost prices a draft step in seeded runs
    backend: Backend | None = None
    capabilities: DrafterCapabilities = DrafterCapabilities()

    @property
    def identity(self) -> str:
        """What ``measure_step``'s figure is cached under: the drafting model and how it runs. A drafter that declares
        ``measures_steps`` overrides it (the class name alone would share one figure across models)."""
        return type(self).__name__

    @abstractmethod
    def begin(self, settings: DraftSettings) -> None:
        """Start a sequence (or start over on the same one): forget per-sequence state, keep ``settings`` for its steps.

        Raises ConfigError for settings this drafter cannot serve (for example sampling with a greedy-only drafter).
        """

    @abstractmethod
    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        """Propose up to ``k`` tokens following ``context`` [T] (every token so far, on the host).

        ``branches``: the most children a draft node may have in this proposal; 1 asks for a chain, more lets a tree
        drafter (``capabilities.trees``) branch.
        """

    def accept(self, n: int) -> None:  # noqa: B027 - an optional hook: most drafters keep nothing per step
        """The target accepted the first ``n`` tokens of the last proposal.

        Called after every step that proposed, never after one that did not.
        """

    def finish(self, tokens: torch.Tensor, prompt_length: int) -> None:  # noqa: B027 - an optional hook
        """The sequence ended (done, cancelled or failed): ``tokens`` [T] are its prompt (the first ``prompt_length``)
        and its output. A drafter that learns across sequences keeps what it may use for later ones."""

    @abstractmethod
    def fork(self) -> Drafter:
        """A drafter with the same knowledge (weights, tables) and its own per-sequence state, for another sequence."""

    def observe_features(self, features: torch.Tensor) -> None:  # noqa: B027 - called only with capabilities.features
        """The target's final hidden states [n, H] of the n positions its cache took in the last step."""

    def measure_step(self, branches: int = 1) -> float:
        """Seconds of one draft step drafting ``branches`` nodes a level, on this machine
        (capabilities.measures_steps)."""
        raise NotImplementedError(f"{type(self).__name__} runs no model of its own to measure")
