"""Chain two drafters: the first proposes when it can, the second otherwise; for trees, both in one tree.

Prompt lookup is free and right whenever the text repeats its context; a
distilled model costs a little and helps on new text. Asking the cheap one
first gets both. The second drafter's cache simply lags while the first one
drafts: on its next call it reads the tokens it missed.

When trees are asked for and the second drafter scores its nodes (the eagle
head), a copy from the context and the head's guesses need not exclude each
other: both are drafted and merged into one tree, and the engine's cost model
keeps the nodes worth verifying.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, DraftSettings, Proposal, TokenTrie

FIRST_NODE_SCORE = (
    0.6  # the chance given to each further node of the first drafter's unscored draft when merged (a node at depth d: 0.6**d)
)


class FallbackDrafter:
    def __init__(self, first: Drafter, second: Drafter) -> None:
        self.first, self.second = first, second
        self.vocab_size = second.vocab_size if second.vocab_size is not None else first.vocab_size
        self.backend = second.backend if second.backend is not None else first.backend  # the costlier one prices a draft token
        self._readers = [d for d in (first, second) if getattr(d, "wants_features", False)]  # drafters of the target's hidden states
        self.wants_features = bool(self._readers)
        self.scored = getattr(second, "scored", False)  # its proposals may carry scores (the first's are cut to the policy's k)
        self._proposed: list[Drafter] = [first]

    def begin(self, settings: DraftSettings) -> None:
        self.first.begin(settings)
        self.second.begin(settings)
        self._proposed = [self.first]

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        proposal = self.first.propose(context, k, branches)
        self._proposed = [self.first]
        if not len(proposal) or (self.scored and branches > 1):
            theirs = self.second.propose(context, k, branches)
            if not len(proposal):
                proposal, self._proposed = theirs, [self.second]
            elif proposal.probs is None and theirs.probs is None:  # deterministic trees merge; drawn ones keep their own law
                proposal, self._proposed = merge_trees(proposal, theirs, k), [self.first, self.second]
        return proposal

    def accept(self, n: int) -> None:
        """Tell the drafter whose proposal was verified; for a merged tree both are told the merged count (neither learns
        from it today: prompt lookup and the eagle head keep no per-proposal state)."""
        for drafter in self._proposed:
            drafter.accept(n)

    def observe_features(self, features: torch.Tensor) -> None:
        for drafter in self._readers:  # every step, whichever drafted: a reader must see every position
            drafter.observe_features(features)

    def fork(self) -> FallbackDrafter:
        return FallbackDrafter(self.first.fork(), self.second.fork())


def merge_trees(first: Proposal, second: Proposal, k: int, first_score: float = FIRST_NODE_SCORE) -> Proposal:
    """One deterministic tree of both proposals' nodes (the same token after the same path is one node), its k best.

    Scores: the second's own, ``first_score ** depth`` for the first's nodes, the higher where both propose a node. A
    parent scores at least as much as its children in both, so the nodes listed best first (shallower first among
    equals) keep parents before children, as a scored proposal must.
    """
    trie = TokenTrie()
    scores: list[float] = []
    depths: list[int] = []
    for proposal in (first, second):
        links = proposal.parents if proposal.parents is not None else torch.arange(-1, len(proposal) - 1)
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
    )
