"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

No model and near-zero cost; it wins on text that repeats its input (code
edits, extraction, summaries that quote). Its proposals are deterministic, so
the verifier treats its distribution as one-hot. With branches (a tree), it
proposes what followed several earlier matches at once, merged where they agree.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.errors import ConfigError


class PromptLookupDrafter(Drafter):
    capabilities = DrafterCapabilities(trees=True)
    vocab_size = None
    backend = None  # no model drafts

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, settings: DraftSettings) -> None:
        pass  # copies are deterministic: the same for greedy and sampled sequences

    def accept(self, n: int) -> None:
        pass

    def fork(self) -> PromptLookupDrafter:
        return type(self)(self.max_ngram, self.min_ngram)

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        """Up to k tokens that followed the most recent earlier match of the longest possible suffix.

        With branches, a tree of up to k nodes: the continuations of the ``branches`` best distinct matches (longest
        suffix first, then most recent), the best one whole, as the chain would propose it, the others in the nodes it
        leaves: a tree step never drafts less of the likeliest copy than a chain step.
        """
        length = context.shape[0]
        runs: list[list[int]] = []
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = context[: length - 1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == context[length - n :]).all(dim=1).nonzero().squeeze(1)
            if branches == 1 and hits.numel():
                start = int(hits[-1]) + n
                return Proposal(context[start : start + k], steps=0)
            for hit in reversed(hits.tolist()):
                run = context[hit + n : hit + n + k].tolist()
                if run not in runs:
                    runs.append(run)
                if len(runs) == branches:
                    break
            if len(runs) == branches:
                break
        if not runs:
            return Proposal(context[:0], steps=0)
        return Proposal.tree(runs, k, steps=0)
