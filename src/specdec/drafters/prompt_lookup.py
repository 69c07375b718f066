"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

No model and near-zero cost; it wins on text that repeats its input (code
edits, extraction, summaries that quote). Its proposals are deterministic, so
the verifier treats its distribution as one-hot.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftSettings, Proposal
from specdec.errors import ConfigError


class PromptLookupDrafter:
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
        return self  # no per-sequence state

    def propose(self, context: torch.Tensor, k: int) -> Proposal:
        """Up to k tokens that followed the most recent earlier match of the longest possible suffix."""
        length = context.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = context[: length - 1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == context[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return Proposal(context[start : start + k])
        return Proposal(context[:0])
