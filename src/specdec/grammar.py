"""Structured output: a grammar (JSON schema, any JSON object, regex, Lark or llama.cpp's GBNF) that every token must
keep the output inside, enforced with llguidance.

A sequence's :class:`Constraint` holds the grammar's state after its accepted output. The step asks it three things:
how many of its deterministic drafts (a chain or a tree) the grammar allows (the rest are cut before scoring: they
could never be accepted; a drawn draft is judged and rejected instead, as its residual must be drawn), the mask of
each verified position from that position's own context (the drafts on its path consumed, then rolled back), and to
advance over the tokens the step kept. Masking is part of the target's distribution, so greedy output
equals target-only decoding with the same grammar and sampled output follows the masked law.

llguidance was chosen over xgrammar by measurement (benchmarks/grammar_mask.py: per-token mask cost alike, tens of
microseconds on Gemma's 262k vocabulary) and because it needs no torch or triton build and reads GBNF itself.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import closing
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import numpy as np
import torch

from specdec.config import Grammar
from specdec.errors import ConfigError
from specdec.models.native import kernel_build, ops

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANY_OBJECT = {"type": "object"}  # what JSON mode asks for: one JSON object
# JSON without whitespace between tokens (as json.dumps with separators (",", ":")) unless a schema says otherwise in
# llguidance's "x-guidance" key: a weak model would otherwise fill its budget with whitespace, which JSON allows.
COMPACT = {"whitespace_flexible": False}


class NoConstraint:
    """The constraint of a sequence without a grammar: the step calls it like :class:`Constraint`, nothing changes."""

    reads_logits = False  # mask leaves the logits as they are

    def allowed(self, drafts: torch.Tensor, links: torch.Tensor) -> int:
        return len(drafts)

    def mask(self, logits: torch.Tensor, drafts: torch.Tensor, links: torch.Tensor) -> None:
        pass

    def advance(self, tokens: list[int]) -> None:
        pass


class Constraint:
    """One sequence's grammar state (an llguidance matcher after its accepted output)."""

    reads_logits = True  # mask sets what the grammar forbids to -inf

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar's tokenizer's; logits past it are masked out

    def allowed(self, drafts: torch.Tensor, links: torch.Tensor) -> int:
        """How many leading ``drafts`` (nodes listed parents first, ``links`` each node's parent, -1 the accepted
        output) the grammar allows, each after its own path."""
        with closing(self._walk(drafts, links, len(drafts))) as walk:
            return next((j for j, ok in enumerate(walk) if not ok), len(drafts))

    def mask(self, logits: torch.Tensor, drafts: torch.Tensor, links: torch.Tensor) -> None:
        """Set to -inf, in place, what the grammar forbids in ``logits`` [n + 1, V]: row 0 after the accepted output,
        row j + 1 after node j's path (``links`` as in :meth:`allowed`). A sampled draft the grammar forbids is judged
        (rejected: p = 0 there) at its parent's row; its own row and its children's are never read and repeat its
        parent's mask."""
        rows = logits.shape[0]
        bitmask = np.zeros((rows, (self.vocab_size + 31) // 32), dtype=np.int32)  # bit t of word w: token 32 w + t
        self.matcher.unsafe_compute_mask_ptr(bitmask[0].ctypes.data, bitmask[0].nbytes)
        with closing(self._walk(drafts, links, rows - 1)) as walk:
            for j, ok in enumerate(walk):
                if ok:
                    self.matcher.unsafe_compute_mask_ptr(bitmask[j + 1].ctypes.data, bitmask[j + 1].nbytes)
                else:
                    bitmask[j + 1] = bitmask[int(links[j]) + 1]
        width = min(self.vocab_size, logits.shape[1])
        _forbid(logits, torch.from_numpy(bitmask), width)
        logits[:, width:] = float("-inf")

    def _walk(self, drafts: torch.Tensor, links: torch.Tensor, count: int) -> Iterator[bool]:
        """For each of the first ``count`` nodes, whether the grammar allows its path; while a True is held the matcher
        is in the state after that path. Closed, the matcher is back after the accepted output."""
        valid: list[bool] = []
        path: list[int] = []  # the nodes consumed, nearest the accepted output first
        try:
            for j in range(min(count, len(drafts))):
                parent = int(links[j])
                if parent >= 0 and not valid[parent]:
                    valid.append(False)
                else:
                    while path and path[-1] != parent:  # back up to the parent's state
                        self.matcher.rollback(1)
                        path.pop()
                    valid.append(self.matcher.try_consume_tokens([int(drafts[j])]) == 1)
                    if valid[-1]:
                        path.append(j)
                yield valid[-1]
        finally:
            self.matcher.rollback(len(path))

    def advance(self, tokens: list[int]) -> None:
        """Consume the tokens a step kept (each the grammar's choice or allowed by it; once the grammar is complete,
        only end-of-sequence, which ends the output)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused kept token {token}: {self.matcher.get_error()}")


def _forbid(logits: torch.Tensor, bits: torch.Tensor, width: int) -> None:
    """-inf, in place, where the packed mask ``bits`` forbids: by the native kernel where this process has loaded it
    and the logits are float32 rows on the CPU (it skips the words that allow all 32 tokens and unpacks nothing), else
    by torch."""
    if kernel_build.loaded() is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1:
        ops.forbid(logits, bits, width)
    else:
        ops.forbid_reference(logits, bits, width)


class GrammarCompiler:
    """Builds constraints for one tokenizer; the tokenizer's table for llguidance is made once, on first use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self._table = None
        self._lock = threading.Lock()

    def constraint(self, grammar: Grammar | None) -> Constraint | NoConstraint:
        """A fresh sequence's constraint for ``grammar``, compiled once (a matcher of its own: no state is shared
        between sequences); ConfigError naming what is wrong with one that does not compile."""
        if grammar is None:
            return NoConstraint()
        table = self._tokenizer_table()
        kind, source = grammar.kind, grammar.source
        if kind in ("json", "json_schema"):
            kind, source = "json_schema", _compact_schema(source)
        try:
            matcher = llguidance.LLMatcher(table, llguidance.grammar_from(kind, source))
        except ValueError as exc:
            raise ConfigError(f"the {grammar.kind} grammar does not compile: {exc}") from None
        if matcher.is_error():  # the matcher holds what validating the grammar would have said
            problem = (matcher.get_error().strip().splitlines() or ["no reason given"])[0]
            raise ConfigError(f"the {grammar.kind} grammar does not compile: {problem}")
        return Constraint(matcher, table.vocab_size)

    def _tokenizer_table(self):
        if self.tokenizer is None:
            raise ConfigError("structured output needs the model's tokenizer, and this model has none")
        with self._lock:
            if self._table is None:
                eos = sorted(self.eos_ids) or None
                try:
                    self._table = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=eos)
                except ValueError as exc:
                    raise ConfigError(f"structured output cannot read this model's tokenizer: {exc}") from None
            return self._table


def _compact_schema(source: str) -> str:
    """A JSON schema's text with COMPACT output unless it sets its own "x-guidance"; ``""`` is any JSON object."""
    try:
        schema = json.loads(source) if source else dict(ANY_OBJECT)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
    schema.setdefault("x-guidance", COMPACT)
    return json.dumps(schema)
