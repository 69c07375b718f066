"""Long-generation guards: functions of the tokens so far, applied to the logits of every position.

Because each guard depends only on the context, the engine can apply it at every
position of a verification window exactly as target-only decoding applies it at
each step; speculative output then equals the guarded target's own output
(greedy) or follows its distribution (sampling). See GuardConfig for the knobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from specdec.config import GuardConfig


@dataclass(frozen=True)
class Loop:
    """The output ends in ``copies`` copies of ``unit`` (the last ``len(unit)`` tokens)."""

    unit: tuple[int, ...]
    copies: int

    @property
    def next_token(self) -> int:
        """The token that would start the next copy."""
        return self.unit[0]


def find_loop(
    tokens: Sequence[int],
    repeats: int = 3,
    min_span: int = 24,
    max_unit: int = 64,
    ignorable: frozenset[int] = frozenset(),
) -> Loop | None:
    """The loop ``tokens`` ends in, or None.

    A loop is one unit (1..max_unit tokens) repeated at least ``repeats`` times
    back to back, covering at least ``min_span`` tokens, at the very end. A unit
    made only of ``ignorable`` tokens (whitespace, punctuation: indentation,
    rules, table borders) is legitimate repetition and never a loop; so is a
    repeat that later text broke (only the end counts).
    """
    tokens = list(tokens[-max(min_span, repeats * max_unit) :])
    n = len(tokens)
    for size in range(1, max_unit + 1):
        copies = max(repeats, -(-min_span // size))
        if copies * size > n:
            if repeats * size > n:
                return None
            continue
        tail = tokens[n - copies * size :]
        if tail[size:] == tail[:-size]:
            unit = tuple(tokens[n - size :])
            if not all(t in ignorable for t in unit):
                return Loop(unit, copies)
    return None


def ngram_followers(tokens: Sequence[int], n: int) -> set[int]:
    """Tokens that, appended to ``tokens``, would repeat one of its n-grams."""
    if len(tokens) < n:
        return set()
    key = list(tokens[len(tokens) - n + 1 :])
    return {tokens[i + n - 1] for i in range(len(tokens) - n + 1) if list(tokens[i : i + n - 1]) == key}


def ignorable_tokens(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids whose text is only whitespace and punctuation (never a loop's unit on their own)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if not any(ch.isalnum() for ch in text))


class NoGuards:
    """The guard hook of a sequence without guards: the decode step calls it like :class:`Guards`, and nothing
    changes."""

    def anchor_due(self, new_tokens: int) -> bool:
        return False

    def trim(self, context: torch.Tensor, drafts: torch.Tensor) -> int:
        return drafts.shape[0]

    def adjust(self, context: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        return None

    def settle(self, at: int, accepted: int, anchored: bool) -> list[dict[str, object]]:
        return []


class Guards:
    """The guards of one generation, as the decode step's hook: when to anchor, draft trimming, logits adjustments,
    events.

    The step calls, for each of its sequence's steps: :meth:`anchor_due` (a
    target-only step?), :meth:`trim` on deterministic drafts, :meth:`adjust`
    on the target's logits at the verified positions, and :meth:`settle` once the step is decided.
    """

    def __init__(self, config: GuardConfig, prompt_length: int, ignorable: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.prompt_length = prompt_length
        self.ignorable = ignorable
        self.next_anchor = config.anchor_every
        self.anchor_requested = False  # set by a drift event when config.drift_anchor
        self._loops: dict[int, Loop | None] = {}  # accepted output length -> the loop the output of that length ends in
        self._context: tuple[torch.Tensor, list[int]] | None = None  # the step's context, read into a list once
        self._blocked: list[int] = []  # positions of the last adjust() where a loop was blocked

    def _as_list(self, context: torch.Tensor) -> list[int]:
        if self._context is None or self._context[0] is not context:
            self._context = (context, context.tolist())
        return self._context[1]

    def _loop_at(self, output: list[int], length: int, accepted: int) -> Loop | None:
        """The loop ``output[:length]`` ends in (remembered for accepted prefixes, which never change)."""
        if length <= accepted and length in self._loops:
            return self._loops[length]
        c = self.config
        found = find_loop(output[:length], c.loop_repeats, c.loop_min_span, c.loop_max_unit, self.ignorable)
        if length <= accepted:
            self._loops[length] = found
        return found

    def blocked(self, context: list[int], accepted: int) -> set[int]:
        """Tokens the repetition guard forbids after ``context`` (whose first ``accepted`` tokens are accepted output or
        prompt).

        Empty unless the output ended in a loop at most loop_cooldown tokens ago; then
        every token that would repeat an n-gram of the output, and the token that
        would continue a loop the output ends in now.
        """
        c = self.config
        if not c.repetition:
            return set()
        output = context[self.prompt_length :]
        accepted -= self.prompt_length
        now = self._loop_at(output, len(output), accepted)
        recent = range(len(output) - 1, max(len(output) - c.loop_cooldown, 0), -1)
        if now is None and not any(self._loop_at(output, length, accepted) for length in recent):
            return set()
        return ngram_followers(output, c.block_ngram) | ({now.next_token} if now else set())

    def temperature_at(self, new_index: int) -> float:
        """The scheduled temperature of output token ``new_index`` (0-based)."""
        start, end = self.config.temperature_schedule  # type: ignore[misc]
        return start + (end - start) * min(new_index / self.config.schedule_tokens, 1.0)

    def adjust(self, context: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """Block looping tokens in ``logits`` [n + 1, V] (in place) at the positions following ``context + drafts[:i]``.

        Returns the scheduled temperature of each position [n + 1] for the
        verifier (None without a schedule); the request's own temperature
        still shapes the drafts, which exact verification allows.
        """
        c = self.config
        self._blocked = []
        if c.repetition:
            tokens, extra = self._as_list(context), drafts.tolist()
            for i in range(logits.shape[0]):
                if banned := self.blocked(tokens + extra[:i], len(tokens)):
                    logits[i, list(banned)] = float("-inf")
                    self._blocked.append(i)
        if c.temperature_schedule is None:
            return None
        produced = context.shape[0] - self.prompt_length
        return torch.tensor([self.temperature_at(produced + i) for i in range(logits.shape[0])]).to(logits.device)

    def trim(self, context: torch.Tensor, drafts: torch.Tensor) -> int:
        """How many leading draft tokens the guard lets through (for deterministic drafts: a blocked token would be
        rejected)."""
        if not self.config.repetition:
            return drafts.shape[0]
        tokens, extra = self._as_list(context), drafts.tolist()
        for i, token in enumerate(extra):
            if token in self.blocked(tokens + extra[:i], len(tokens)):
                return i
        return len(extra)

    def anchor_due(self, new_tokens: int) -> bool:
        """Whether the next step is a target-only anchor step (every anchor_every tokens, or after a drift event)."""
        due = self.anchor_requested or (self.next_anchor is not None and new_tokens >= self.next_anchor)
        if due:
            self.anchor_requested = False
            if self.next_anchor is not None:
                while self.next_anchor <= new_tokens:
                    self.next_anchor += self.config.anchor_every  # type: ignore[operator]
        return due

    def settle(self, at: int, accepted: int, anchored: bool) -> list[dict[str, object]]:
        """Events of the step just decided, whose first new token is output token ``at``: loops blocked where output
        was kept, an anchor."""
        events: list[dict[str, object]] = [
            {"kind": "loop_blocked", "at": at + i} for i in self._blocked if i <= accepted
        ]
        self._blocked = []
        return events + ([{"kind": "anchor", "at": at}] if anchored else [])
