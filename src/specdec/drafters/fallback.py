"""Chain two drafters: the first proposes when it can, the second otherwise; for trees, both in one tree.

Prompt lookup is free and right whenever the text repeats its context; a
distilled model costs a little and helps on new text. Asking the cheap one
first gets both. The second drafter's cache simply lags while the first one
drafts: on its next call it reads the tokens it missed.

When trees are asked for and the second drafter scores its nodes (the eagle
head), a copy from the context and the head's guesses need not exclude each
other: both are drafted and merged into one tree, and the engine's cost model
keeps the nodes worth verifying. The first drafter's nodes are scored by how
often its tokens have been the text's next ones in this sequence (checked
against the context at the next step, whichever path the target took), so a
copy that keeps being right is kept whole.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdec.acceptance import AcceptanceEstimate
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal, TokenTrie

FIRST_NODE_SCORE = 0.6  # before any evidence, the chance that each further token of the first drafter's draft is right


class FallbackDrafter(Drafter):
    def __init__(self, first: Drafter, second: Drafter) -> None:
        self.first, self.second = first, second
        self.vocab_size = second.vocab_size if second.vocab_size is not None else first.vocab_size
        # The costlier one prices a draft step: a drafting model's Backend, else a model outside one (the eagle head).
        self.backend = second.backend if second.backend is not None else first.backend
        self._priced = next((d for d in (second, first) if d.capabilities.measures_steps), None)
        # drafters of the target's hidden states
        self._readers = [d for d in (first, second) if d.capabilities.features]
        self.capabilities = DrafterCapabilities(
            trees=first.capabilities.trees or second.capabilities.trees,
            scores=second.capabilities.scores,  # the second's proposals may carry scores (the first's are cut to k)
            features=bool(self._readers),
            measures_steps=self.backend is None and self._priced is not None,
            learns=first.capabilities.learns or second.capabilities.learns,
        )
        self._proposed: list[Drafter] = [first]
        self._forget()

    def begin(self, settings: DraftSettings) -> None:
        self.first.begin(settings)
        self.second.begin(settings)
        self._proposed = [self.first]
        self._forget()

    def finish(self, tokens: torch.Tensor, prompt_length: int) -> None:
        self.first.finish(tokens, prompt_length)
        self.second.finish(tokens, prompt_length)

    def _forget(self) -> None:
        self.first_rate = AcceptanceEstimate(prior=FIRST_NODE_SCORE)  # how often the first drafter's tokens come true
        # (context length, the first drafter's best run) awaiting the text
        self._copy: tuple[int, list[int]] | None = None

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        self._check_copy(context)
        proposal = self.first.propose(context, k, branches)
        self._proposed = [self.first]
        if len(proposal):
            self._copy = (context.shape[0], proposal.tokens[: _first_run(proposal)].tolist())
        if not len(proposal) or (self.capabilities.scores and branches > 1):
            theirs = self.second.propose(context, k, branches)
            steps = proposal.draft_steps + theirs.draft_steps  # both drafted, whichever proposal is kept
            if not len(proposal):
                proposal, self._proposed = replace(theirs, steps=steps), [self.second]
            elif proposal.probs is None and theirs.probs is None:
                # deterministic trees merge; drawn ones keep their own law
                proposal, self._proposed = (
                    merge_trees(proposal, theirs, k, self.first_rate.value),
                    [self.first, self.second],
                )
            else:
                proposal = replace(proposal, steps=steps)
        return proposal

    def _check_copy(self, context: torch.Tensor) -> None:
        """Score the first drafter's last run against the tokens the text took since (its accepted drafts and the
        target's own next token): the chain acceptance it would have had, whatever was verified."""
        if self._copy is None:
            return
        length, run = self._copy
        self._copy = None
        came = context[length : length + len(run)].tolist()
        judged = run[: len(came)]  # a run longer than the text taken since is judged only as far as the text goes
        right = next((i for i, (a, b) in enumerate(zip(judged, came, strict=True)) if a != b), len(judged))
        self.first_rate.observe(len(judged), right)

    def accept(self, n: int) -> None:
        """Tell the drafter whose proposal was verified; for a merged tree both are told the merged count (neither
        learns from it today: prompt lookup and the eagle head keep no per-proposal state)."""
        for drafter in self._proposed:
            drafter.accept(n)

    def observe_features(self, features: torch.Tensor) -> None:
        for drafter in self._readers:  # every step, whichever drafted: a reader must see every position
            drafter.observe_features(features)

    @property
    def identity(self) -> str:
        return self._priced.identity if self._priced is not None else super().identity

    def measure_step(self, branches: int = 1) -> float:
        if self._priced is None:
            return super().measure_step(branches)
        return self._priced.measure_step(branches)

    def fork(self) -> FallbackDrafter:
        return FallbackDrafter(self.first.fork(), self.second.fork())


def _first_run(proposal: Proposal) -> int:
    """How many of a proposal's first nodes form one run from the root (all of a chain's; a tree lists its best run
    first)."""
    if proposal.parents is None:
        return len(proposal)
    links = proposal.parents.tolist()
    return next((i for i, parent in enumerate(links) if parent != i - 1), len(links))


def merge_trees(first: Proposal, second: Proposal, k: int, first_score: float = FIRST_NODE_SCORE) -> Proposal:
    """One deterministic tree of both proposals' nodes (the same token after the same path is one node), its k best,
    with the drafting both took.

    Scores: the second's own, ``first_score ** depth`` for the first's nodes (first_score: the chance each is right),
    the higher where both propose a node. A parent scores at least as much as its children in both, so the nodes listed
    best first (shallower first among equals) keep parents before children, as a scored proposal must.
    """
    trie = TokenTrie()
    scores: list[float] = []
    depths: list[int] = []
    for proposal in (first, second):
        links = proposal.links
        own = proposal.scores.tolist() if proposal is second and proposal.scores is not None else None
        index: list[int] = []  # this proposal's node i -> its merged node
        for i, (token, link) in enumerate(zip(proposal.tokens.tolist(), links.tolist(), strict=True)):
            parent = index[link] if link >= 0 else -1
            depth = depths[parent] + 1 if parent >= 0 else 1
            score = own[i] if own is not None else first_score**depth
            node = trie.find(parent, token)
            if node is None:
                node = trie.add(parent, token)
                scores.append(score)
                depths.append(depth)
            else:
                scores[node] = max(scores[node], score)
            index.append(node)
    order = sorted(range(len(trie)), key=lambda i: (-scores[i], depths[i], i))[:k]
    place = {node: i for i, node in enumerate(order)}
    return Proposal(
        torch.tensor([trie.tokens[i] for i in order], dtype=torch.long),
        None,
        torch.tensor([place[trie.parents[i]] if trie.parents[i] >= 0 else -1 for i in order], dtype=torch.long),
        torch.tensor([scores[i] for i in order]),
        first.draft_steps + second.draft_steps,
    )
