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
    tokens: Sequence[int], repeats: int = 3, min_span: int = 24, max_unit: int = 64, ignorable: frozenset[int] = frozenset()
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


class Guards:
    """The guards of one generation: logits adjustments, proposal trimming, and when to anchor."""

    def __init__(self, config: GuardConfig, prompt_length: int, temperature: float, ignorable: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.prompt_length = prompt_length
        self.temperature = temperature  # the request's, which shaping divides by
        self.ignorable = ignorable
        self.next_anchor = config.anchor_every
        self.anchor_requested = False  # set by a drift event when config.drift_anchor
        self._loops: dict[int, Loop | None] = {}  # accepted output length -> the loop the output of that length ends in

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
        """Tokens the repetition guard forbids after ``context`` (whose first ``accepted`` tokens are accepted output or prompt).

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

    def adjust(self, tokens: list[int], drafts: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Guarded logits [n, V] for positions following ``tokens + drafts[:i]``; also the positions where a loop was blocked."""
        c = self.config
        if not c.repetition and c.temperature_schedule is None:
            return logits, []
        logits = logits.float().clone()
        blocked = []
        for i in range(logits.shape[0]):
            context = tokens + drafts[:i]
            if banned := self.blocked(context, len(tokens)):
                logits[i, list(banned)] = float("-inf")
                blocked.append(i)
            if c.temperature_schedule is not None:  # shaping divides by the request's temperature: the result is the scheduled one
                logits[i] *= self.temperature / self.temperature_at(len(context) - self.prompt_length)
        return logits, blocked

    def trim(self, tokens: list[int], drafts: list[int]) -> int:
        """How many leading draft tokens the guard lets through (for deterministic drafts: a blocked token would be rejected)."""
        for i, token in enumerate(drafts):
            if token in self.blocked(tokens + drafts[:i], len(tokens)):
                return i
        return len(drafts)

    def anchor_due(self, new_tokens: int) -> bool:
        """Whether the next step is a target-only anchor step (every anchor_every tokens, or after a drift event)."""
        due = self.anchor_requested or (self.next_anchor is not None and new_tokens >= self.next_anchor)
        if due:
            self.anchor_requested = False
            if self.next_anchor is not None:
                while self.next_anchor <= new_tokens:
                    self.next_anchor += self.config.anchor_every  # type: ignore[operator]
        return due
