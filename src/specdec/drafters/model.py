"""A smaller causal LM sharing the target's vocabulary drafts autoregressively with its own KV cache."""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig
from specdec.drafters.base import Proposal
from specdec.models.backend import Backend
from specdec.verification.seeds import Seeds, generator_on
from specdec.verification.shaping import to_probs


class ModelDrafter:
    """Drafts k tokens with a small model; its cache keeps exactly the accepted prefix between steps.

    ``min_confidence`` is the draft's own floor (a distilled draft calibrates one
    on held-out data): below it, its guesses are too rarely right to pay for.
    """

    def __init__(self, backend: Backend, min_confidence: float = 0.0) -> None:
        self.backend = backend
        self.min_confidence = min_confidence
        self.vocab_size: int | None = backend.vocab_size
        self._context_length = 0

    def begin(self, prompt: torch.Tensor) -> None:
        self.backend.reset()
        self._context_length = 0

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, k: int, sampling: SamplingConfig, seeds: Seeds | None, min_confidence: float = 0.0
    ) -> Proposal:
        batch = context.shape[0]
        # The draft's own context limit: the context plus k - 1 fed drafts must fit its positions.
        k = min(k, self.backend.max_context - context.shape[1] + 1)
        if k <= 0:
            self._context_length = self.backend.cached_length  # nothing fed: accepted(0) keeps the cache as it is
            return Proposal.empty(batch, context.device)
        # Feed whatever the cache has not seen yet: the tokens accepted since the last step.
        logits = self.backend.forward(context[:, self.backend.cached_length :], last=1)[:, -1]
        self._context_length = context.shape[1]
        min_confidence = max(min_confidence, self.min_confidence)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if min_confidence and bool((torch.softmax(logits.float(), dim=-1).amax(dim=-1) < min_confidence).all()):
                break  # the draft is unsure of its next token: stop here
            if sampling.greedy:
                token = logits.argmax(dim=-1)
            else:
                dist = to_probs(logits, sampling)
                token = torch.multinomial(dist, 1, generator=generator_on(seeds, dist.device)).squeeze(1)
                probs.append(dist)
            tokens.append(token)
            if i + 1 < k:
                logits = self.backend.forward(token[:, None], last=1)[:, -1]
        if not tokens:
            return Proposal.empty(batch, context.device)
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            lengths=torch.full((batch,), len(tokens), dtype=torch.long, device=context.device),
            probs=torch.stack(probs, dim=1) if probs else None,
        )

    def accepted(self, counts: torch.Tensor) -> None:
        # Called only after a proposal. The cache holds the context plus the first k-1 drafts; keep the context plus the accepted ones.
        # One cache length serves every row: the single-sequence engine passes one row.
        keep = self._context_length + int(counts[0])
        self.backend.truncate(min(keep, self.backend.cached_length))

    def fork(self) -> ModelDrafter:
        return type(self)(self.backend.fork(), self.min_confidence)
