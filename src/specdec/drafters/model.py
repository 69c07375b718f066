"""A smaller causal LM sharing the target's vocabulary drafts autoregressively with its own KV cache."""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.models.backend import Backend
from specdec.seeds import draft_uniform
from specdec.verification.sampling import draw, greedy
from specdec.verification.shaping import to_probs


class ModelDrafter(Drafter):
    """Drafts k tokens with a small model; its cache keeps exactly the accepted prefix between steps.

    ``min_confidence`` is the draft's own floor (a distilled draft calibrates one
    on held-out data): below it, its guesses are too rarely right to pay for.
    """

    capabilities = DrafterCapabilities(trees=True)

    def __init__(self, backend: Backend, min_confidence: float = 0.0) -> None:
        self.backend = backend
        self.min_confidence = min_confidence
        self.vocab_size: int | None = backend.vocab_size
        self.settings = DraftSettings()
        self._context_length = 0
        # the last proposal was a tree: its last accepted node may be a leaf the cache never read
        self._branched = False

    def begin(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.backend.reset()
        self._context_length = 0
        self._branched = False

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        # The draft's own context limit: the context plus k - 1 fed drafts must fit its positions.
        k = min(k, self.backend.max_context - context.shape[0] + 1)
        if k <= 0:
            self._context_length = self.backend.cached_length  # nothing fed: accept(0) keeps the cache as it is
            return Proposal.empty()
        # Feed whatever the cache has not seen yet: the tokens accepted since the last step.
        logits = self.backend.forward(context[None, self.backend.cached_length :], last=1)[0, -1]
        self._context_length = context.shape[0]
        self._branched = branches > 1
        if self._branched:
            return self._tree(logits, k, branches)
        sampling = self.settings.sampling
        min_confidence = self.floor
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if min_confidence and float(torch.softmax(logits.float(), dim=-1).max()) < min_confidence:
                break  # the draft is unsure of its next token: stop here
            if sampling.greedy:
                token = greedy(logits)[..., None]
            else:
                dist = to_probs(logits, sampling)
                uniform = draft_uniform(self.settings.seeds, dist.device, context.shape[0] + i)
                token = draw(dist[None], uniform=uniform)
                probs.append(dist)
            tokens.append(token)
            if i + 1 < k:
                logits = self.backend.forward(token[None], last=1)[0, -1]
        if not tokens:
            return Proposal.empty()
        return Proposal(torch.cat(tokens), torch.stack(probs) if probs else None)

    @property
    def floor(self) -> float:
        """The confidence below which it stops: its own calibrated floor or the k policy's, whichever is higher."""
        return max(self.settings.min_confidence, self.min_confidence)

    def _tree(self, logits: torch.Tensor, k: int, width: int) -> Proposal:
        """A chain of the draft's most likely tokens with, at each depth, its next most likely ones as leaves beside it:
        no more draft steps than the chain, and a second chance wherever the chain's token is rejected. Deterministic
        (verification draws from the target and descends while the draw is a node), so exact when sampling too."""
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        while len(tokens) < k:
            top = torch.softmax(logits.float(), dim=-1).topk(min(width, k - len(tokens)))
            if float(top.values[0]) < self.floor:
                break  # the draft is unsure of its next token: stop here
            chain = len(tokens)
            tokens += top.indices.tolist()
            parents += [parent] * len(top.indices)
            parent = chain
            if len(tokens) < k:
                logits = self.backend.forward(top.indices[:1][None], last=1)[0, -1]
        if not tokens:
            return Proposal.empty()
        return Proposal(torch.tensor(tokens, dtype=torch.long), None, torch.tensor(parents, dtype=torch.long))

    def accept(self, n: int) -> None:
        # Called only after a proposal. The cache holds the context plus the first k-1 drafts; keep the context plus
        # the accepted ones.
        # In a tree the last accepted node may be a leaf the cache never read: keep one fewer (the next step reads it).
        n = max(n - 1, 0) if self._branched else n
        self.backend.truncate(min(self._context_length + n, self.backend.cached_length))

    def fork(self) -> ModelDrafter:
        return type(self)(self.backend.fork(), self.min_confidence)
