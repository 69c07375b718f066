"""A draft model with another tokenizer: it drafts text, which is re-tokenized into target tokens.

Each step the target's tokens so far are decoded to text and tokenized for the
draft; the draft's cache keeps the longest prefix it shares with that, so
rollback needs no bookkeeping. The draft then writes k + 1 of its own tokens;
the text they add is tokenized as the target would tokenize it after the
context, and all but the last resulting token are proposed (the last may be cut
mid-word by the draft's token boundary). The target verifies every token, so
greedy output stays the target's own whatever the re-tokenization gives.
Drafts are deterministic text, with no distribution over target tokens, so
this drafter refuses sampling rather than bias it.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, DraftSettings, Proposal
from specdec.errors import ConfigError
from specdec.models.backend import Backend
from specdec.models.target import Tokenizer


class CrossTokenizerDrafter(Drafter):
    vocab_size = None  # proposes target tokens, whatever its own vocabulary

    def __init__(
        self, backend: Backend, tokenizer: Tokenizer, target_tokenizer: Tokenizer, eos_ids: frozenset[int]
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.target_tokenizer = target_tokenizer
        self.eos_ids = eos_ids
        self._cached: list[int] = []  # the draft tokens whose states the draft's cache holds

    def begin(self, settings: DraftSettings) -> None:
        if not settings.sampling.greedy:
            raise ConfigError(
                "a draft with another tokenizer supports greedy decoding only (its drafts have no distribution over "
                "the target's tokens): use temperature 0, or --draft prompt-lookup / ngram:FILE for sampling"
            )
        self.backend.reset()
        self._cached = []

    def accept(self, n: int) -> None:
        pass  # the next proposal re-reads the context and keeps the common prefix

    def fork(self) -> CrossTokenizerDrafter:
        return CrossTokenizerDrafter(self.backend.fork(), self.tokenizer, self.target_tokenizer, self.eos_ids)

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        target_ids = context.tolist()
        text = self.target_tokenizer.decode(target_ids, skip_special_tokens=True)
        draft_ids = self.tokenizer(text)["input_ids"]
        drafted = self._draft(draft_ids, k + 1)
        new_text = self._added_text(draft_ids, drafted)
        ended = bool(drafted) and drafted[-1] in self.eos_ids
        proposal = self._target_tokens(target_ids, new_text)
        proposal = proposal[:k] if ended else proposal[: min(k, len(proposal) - 1)]
        return Proposal(torch.tensor(proposal, dtype=torch.long))

    def _draft(self, draft_ids: list[int], count: int) -> list[int]:
        """Greedily continue ``draft_ids`` by up to ``count`` draft tokens, reusing the cached prefix."""
        count = min(count, self.backend.max_context - len(draft_ids) + 1)  # the draft's own context limit
        if not draft_ids or count <= 0:
            return []
        keep = 0
        limit = min(len(self._cached), len(draft_ids) - 1)  # at least one token must be fed to get logits
        while keep < limit and self._cached[keep] == draft_ids[keep]:
            keep += 1
        try:
            self.backend.truncate(keep)
        except ValueError:  # a sliding-window cache that no longer holds what keep needs: from the start again
            keep = 0
            self.backend.reset()
        logits = self.backend.forward(torch.tensor([draft_ids[keep:]]), last=1)[0, -1]
        self._cached = list(draft_ids)
        drafted: list[int] = []
        for i in range(count):
            token = int(logits.argmax())
            drafted.append(token)
            if token in self.eos_ids or i + 1 == count:
                break
            logits = self.backend.forward(torch.tensor([[token]]), last=1)[0, -1]
            self._cached.append(token)
        return drafted

    def _added_text(self, draft_ids: list[int], drafted: list[int]) -> str:
        """The text ``drafted`` adds after ``draft_ids``, decoded in context (some tokenizers drop a leading space
        alone)."""
        before = self.tokenizer.decode(draft_ids, skip_special_tokens=True)
        after = self.tokenizer.decode(draft_ids + drafted, skip_special_tokens=True)
        added = (
            after[len(before) :]
            if after.startswith(before)
            else self.tokenizer.decode(drafted, skip_special_tokens=True)
        )
        return added.rstrip("\ufffd")  # a character cut in the middle of its bytes

    def _target_tokens(self, target_ids: list[int], added: str) -> list[int]:
        """``added`` as target tokens following ``target_ids``."""
        if not added:
            return []
        context = self.target_tokenizer.decode(target_ids, skip_special_tokens=False)
        joint = self.target_tokenizer(context + added, add_special_tokens=False)["input_ids"]
        if joint[: len(target_ids)] == target_ids:
            return joint[len(target_ids) :]
        # The context does not re-tokenize to itself (the target produced a non-canonical split): tokenize the new
        # text alone.
        return self.target_tokenizer(added, add_special_tokens=False)["input_ids"]
