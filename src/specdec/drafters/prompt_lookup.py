"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

No model and near-zero cost; it wins on text that repeats its input (code
edits, extraction, summaries that quote). Its proposals are deterministic, so
the verifier treats its distribution as one-hot.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig
from specdec.drafters.base import Proposal
from specdec.errors import ConfigError
from specdec.verification.seeds import Seeds


class PromptLookupDrafter:
    vocab_size = None
    backend = None  # no model drafts

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def propose(
        self, context: torch.Tensor, k: int, sampling: SamplingConfig, seeds: Seeds | None, min_confidence: float = 0.0
    ) -> Proposal:
        rows = [self._lookup(row, k) for row in context]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=context.device)
        tokens = torch.zeros(context.shape[0], max((len(r) for r in rows), default=0), dtype=torch.long, device=context.device)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
        return Proposal(tokens, lengths)

    def accepted(self, counts: torch.Tensor) -> None:
        pass

    def fork(self) -> PromptLookupDrafter:
        return self  # no per-sequence state

    def _lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens that followed the most recent earlier match of the longest possible suffix."""
        length = seq.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = seq[: length - 1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == seq[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return seq[start : start + k]
        return seq[:0]
