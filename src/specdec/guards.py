"""Long-generation guards: functions of the tokens so far, applied to the logits of every position.

Because each guard depends only on the context, the engine can apply it at every
position of a verification window exactly as target-only decoding applies it at
each step; speculative output then equals the guarded target's own output
(greedy) or follows its distribution (sampling). See GuardConfig for the knobs.
The drift monitor (:class:`DriftMonitor`) reads the output's text instead and
changes no output, only when anchors fall.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
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


def ignorable_tokens(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids whose text is only whitespace and punctuation (never a loop's unit on their own)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if not any(ch.isalnum() for ch in text))


class LoopScan:
    """:func:`find_loop` at every length of a growing sequence, in O(loop_max_unit) work per token whatever its length.

    For each unit size s it keeps how many trailing tokens equal the token s before them: the sequence ends in c
    copies of its last s tokens exactly when that run covers (c - 1) * s tokens. :meth:`push` adds accepted tokens;
    :meth:`extend` scans a step's drafts from there without changing what was accepted.
    """

    def __init__(self, config: GuardConfig, ignorable: frozenset[int] = frozenset()) -> None:
        self.sizes = np.arange(1, config.loop_max_unit + 1)
        self.copies = np.maximum(config.loop_repeats, -(-config.loop_min_span // self.sizes))
        self.need = (self.copies - 1) * self.sizes  # trailing repeats a loop of each unit size needs
        self.span = self.copies * self.sizes  # and the tokens it covers
        self.window = max(config.loop_min_span, config.loop_repeats * config.loop_max_unit)  # find_loop's
        self.ignorable = ignorable
        self.tokens = np.zeros(256, dtype=np.int64)  # accepted, then the drafts last scanned
        self.meaningful = np.zeros(257, dtype=np.int64)  # [n]: how many of the first n tokens are not ignorable
        self.length = 0  # accepted tokens
        self.runs = np.zeros(len(self.sizes), dtype=np.int64)  # at self.length
        self.loops: list[int] = []  # accepted lengths at which the sequence ends in a loop, increasing
        self.units: dict[int, int] = {}  # such a length -> its loop's unit size

    def push(self, token: int) -> None:
        """Accept one more token."""
        self._put(self.length, token)
        self.runs, unit = self._advance(self.runs, self.length)
        self.length += 1
        if unit is not None:
            self.loops.append(self.length)
            self.units[self.length] = unit

    def next_token(self, length: int) -> int | None:
        """The token that would continue the loop the accepted sequence of ``length`` tokens ends in (None: none)."""
        unit = self.units.get(length)
        return None if unit is None else int(self.tokens[length - unit])

    def looped_within(self, first: int, last: int) -> bool:
        """Whether the accepted sequence ended in a loop at some length in first..last."""
        at = bisect.bisect_right(self.loops, last)
        return at > 0 and self.loops[at - 1] >= first

    def extend(self, drafts: list[int]) -> list[int | None]:
        """For the accepted tokens followed by each non-empty prefix of ``drafts``: the token that would continue the
        loop it ends in (None: none)."""
        runs, nexts = self.runs, []
        for i, token in enumerate(drafts):
            self._put(self.length + i, token)
            runs, unit = self._advance(runs, self.length + i)
            nexts.append(None if unit is None else int(self.tokens[self.length + i + 1 - unit]))
        return nexts

    def _put(self, at: int, token: int) -> None:
        if at >= len(self.tokens):
            self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
            self.meaningful = np.concatenate([self.meaningful, np.zeros_like(self.meaningful)])
        self.tokens[at] = token
        self.meaningful[at + 1] = self.meaningful[at] + (token not in self.ignorable)

    def _advance(self, runs: np.ndarray, at: int) -> tuple[np.ndarray, int | None]:
        """The runs once the token written at ``at`` follows, and the unit size of the loop the sequence then ends in
        (the smallest, as find_loop finds it; None: no loop)."""
        seen = min(at, len(self.sizes))
        same = np.zeros(len(self.sizes), dtype=bool)
        same[:seen] = self.tokens[at - seen : at][::-1] == self.tokens[at]  # [s - 1]: the token s before
        runs = (runs + 1) * same
        n = at + 1
        found = (runs >= self.need) & (self.span <= min(n, self.window))
        if self.ignorable:  # a unit of ignorable tokens only is no loop
            found &= self.meaningful[n] > self.meaningful[np.maximum(n - self.sizes, 0)]
        hits = np.flatnonzero(found)
        return runs, int(hits[0]) + 1 if hits.size else None


class NoGuards:
    """The guard hook of a sequence without guards: the decode step calls it like :class:`Guards`, and nothing
    changes."""

    reads_logits = False  # adjust leaves the logits as they are

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
        self._anchor_requested = False  # by a drift event (request_anchor)
        self._blocked: list[int] = []  # positions of the last adjust() where a loop was blocked
        # The repetition guard's view of the accepted output, read as it grows (accepted output never changes): its
        # tokens, its loops, and (from the first block on) its n-grams by their first n - 1 tokens.
        self._output: list[int] = []
        self._scan = LoopScan(config, ignorable)
        self._ngrams: dict[tuple[int, ...], set[int]] | None = None
        # the last drafts scanned: the accepted length they followed, the drafts, LoopScan.extend's answer
        self._drafts: tuple[int, list[int], list[int | None]] = (0, [], [])

    @property
    def reads_logits(self) -> bool:
        """Whether adjust changes the logits (the repetition guard masks them; a schedule's temperatures judge them)."""
        return bool(self.config.repetition) or self.config.temperature_schedule is not None

    def _sync(self, context: torch.Tensor) -> None:
        """Read the output ``context`` (prompt and accepted output) holds beyond what was read."""
        produced = context.shape[0] - self.prompt_length
        if produced < len(self._output):  # not this sequence's continuation: read it afresh
            self._output, self._scan, self._ngrams = [], LoopScan(self.config, self.ignorable), None
            self._drafts = (0, [], [])
        for token in context[self.prompt_length + len(self._output) :].tolist():
            self._output.append(token)
            self._scan.push(token)
            if self._ngrams is not None:
                self._index(self._ngrams, len(self._output))

    def _index(self, ngrams: dict[tuple[int, ...], set[int]], end: int) -> None:
        """Add the n-gram that ends ``self._output[:end]`` to ``ngrams``."""
        n = self.config.block_ngram
        if end >= n:
            ngrams.setdefault(tuple(self._output[end - n : end - 1]), set()).add(self._output[end - 1])

    def _draft_loops(self, drafts: list[int]) -> list[int | None]:
        """LoopScan.extend over ``drafts``, reusing the last scan when these drafts begin it (trim, then adjust)."""
        length, scanned, nexts = self._drafts
        if length != len(self._output) or drafts != scanned[: len(drafts)]:
            self._drafts = (len(self._output), drafts, self._scan.extend(drafts))
            return self._drafts[2]
        return nexts[: len(drafts)]

    def _blocks(self, context: torch.Tensor, drafts: list[int]) -> Iterator[set[int]]:
        """The tokens the repetition guard forbids after ``context`` followed by drafts[:i], for i = 0, 1, ... (lazily).

        Empty unless the output ended in a loop at most loop_cooldown tokens ago; then every token that would repeat an
        n-gram of the output, and the token that would continue a loop the output ends in now.
        """
        self._sync(context)
        c, scan = self.config, self._scan
        accepted = len(self._output)
        nexts = [scan.next_token(accepted), *self._draft_loops(drafts)]
        drafted_loop = 0  # the longest draft-extended length so far at which the output ends in a loop (0: none)
        for i, now in enumerate(nexts):
            length = accepted + i
            first = max(length - c.loop_cooldown, 0) + 1  # the earliest length still in the cooldown
            looped = now is not None or drafted_loop >= first or scan.looped_within(first, min(accepted, length - 1))
            yield (self._followers(drafts, i) | ({now} if now is not None else set())) if looped else set()
            if now is not None and i:
                drafted_loop = length

    def _followers(self, drafts: list[int], i: int) -> set[int]:
        """Tokens that, after the output and drafts[:i], would repeat one of its n-grams."""
        n, accepted = self.config.block_ngram, len(self._output)
        length = accepted + i
        if length < n:
            return set()
        if self._ngrams is None:
            self._ngrams = {}
            for end in range(n, accepted + 1):
                self._index(self._ngrams, end)
        start = max(accepted - n + 1, 0)  # the output from here on, then the drafts: every n-gram that ends in a draft
        tail = self._output[start:] + drafts[:i]
        key = tuple(tail[length - n + 1 - start : length - start])
        found = set(self._ngrams.get(key, ()))
        for end in range(max(accepted, n - 1), length):  # the n-grams that end in drafts[:i]
            if tuple(tail[end - n + 1 - start : end - start]) == key:
                found.add(tail[end - start])
        return found

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
            for i, banned in enumerate(self._blocks(context, drafts.tolist())):  # one per row of logits
                if banned:
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
        extra = drafts.tolist()
        # the blocks after the last draft are never read
        for i, (token, banned) in enumerate(zip(extra, self._blocks(context, extra), strict=False)):
            if token in banned:
                return i
        return len(extra)

    def request_anchor(self) -> None:
        """Make the next step an anchor step (a drift event with drift_anchor asks for one)."""
        self._anchor_requested = True

    def anchor_due(self, new_tokens: int) -> bool:
        """Whether the next step is a target-only anchor step (every anchor_every tokens, or after a drift event)."""
        due = self._anchor_requested or (self.next_anchor is not None and new_tokens >= self.next_anchor)
        if due:
            self._anchor_requested = False
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


class Embedder(Protocol):
    """What the drift monitor compares text with (quality/embedding.py's SentenceEmbedder is one)."""

    def similarity(self, reference: str, texts: list[str]) -> list[float]:
        """Cosine similarity of each text to ``reference``."""
        ...


class DriftMonitor:
    """Watches one generation's output for drift from its prompt: the text of each ``drift_window`` output tokens is
    compared with the prompt's; below ``drift_threshold``, a drift event, and with ``drift_anchor`` the generation's
    ``guards`` take an anchor step next.

    Unlike the guards above it reads text, not logits: it changes no output, only when anchors fall.
    """

    def __init__(self, guards: Guards, prompt: str, decode: Callable[[list[int]], str], embedder: Embedder) -> None:
        if guards.config.drift_threshold is None:
            raise ValueError("a drift monitor needs GuardConfig.drift_threshold")
        self.guards, self.prompt, self.decode, self.embedder = guards, prompt, decode, embedder
        self.threshold = guards.config.drift_threshold

    def watch(self, output: list[int], before: int) -> list[dict[str, object]]:
        """Drift events of each window of ``output`` (the generation's tokens) completed since its first ``before``."""
        config, events = self.guards.config, []
        size = config.drift_window
        for end in range(size * (before // size + 1), len(output) + 1, size):
            similarity = self.embedder.similarity(self.prompt, [self.decode(output[end - size : end])])[0]
            if similarity < self.threshold:
                events.append({"kind": "drift", "at": end, "similarity": round(similarity, 4)})
                if config.drift_anchor:
                    self.guards.request_anchor()
        return events
