"""A corpus n-gram drafter: prompt lookup first, then a precomputed table of what follows each context.

The table maps hashed contexts of 1..N tokens to the tokens that followed them
in a corpus, with counts. It lives in one sorted uint64 array whose keys are
(context hash << vocab bits) | next token, so every context's followers are one
contiguous range found by binary search: no Python objects per entry, loading
is a single read, and a proposal costs a few searches (well under a millisecond).
Hash collisions only make a draft worse, never the output: the target verifies every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import ConfigError, ModelNotFoundError
from specdec.seeds import draft_uniform
from specdec.verification.sampling import draw

FORMAT = "specdec-ngram"
VERSION = 1
MASK64 = (1 << 64) - 1
PRIME = 0x100000001B3


def _mix(z):
    """splitmix64's finaliser: spreads every input bit over the hash (works on Python ints and uint64 arrays)."""
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64 if isinstance(z, int) else z * np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64 if isinstance(z, int) else z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> 31)


def context_hash(context: list[int] | tuple[int, ...]) -> int:
    """The hash of one context (its length is part of it)."""
    h = len(context)
    for token in context:
        h = (h * PRIME + token + 1) & MASK64
    return _mix(h)


def context_hashes(tokens: np.ndarray, order: int) -> np.ndarray:
    """Hashes of every window of ``order`` tokens in ``tokens``, equal to :func:`context_hash` of each."""
    windows = len(tokens) - order + 1
    h = np.full(max(windows, 0), order, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(order):
            h = h * np.uint64(PRIME) + tokens[j : j + windows].astype(np.uint64) + np.uint64(1)
        return _mix(h)


def vocab_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


@dataclass
class NgramTable:
    """Sorted keys ``(context hash << bits) | next token`` with their counts, and what built them."""

    keys: np.ndarray  # uint64, sorted
    counts: np.ndarray  # uint32
    order: int  # longest context, in tokens
    vocab_size: int
    meta: dict

    @property
    def bits(self) -> int:
        return vocab_bits(self.vocab_size)

    def followers(self, context: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens seen after exactly this context, and their counts (empty arrays when unseen)."""
        low = (context_hash(context) >> self.bits) << self.bits
        start, end = self.keys.searchsorted(np.array([low, low + (1 << self.bits)], dtype=np.uint64))
        keys = self.keys[start:end]
        return (keys & np.uint64((1 << self.bits) - 1)).astype(np.int64), self.counts[start:end]

    def longest_match(self, context: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Followers of the longest suffix of ``context`` the table has seen (backoff to shorter ones)."""
        for n in range(min(self.order, len(context)), 0, -1):
            tokens, counts = self.followers(context[-n:])
            if len(tokens):
                return tokens, counts
        return np.empty(0, dtype=np.int64), self.counts[:0]

    def save(self, path: str | Path) -> None:
        meta = self.meta | {"format": FORMAT, "version": VERSION, "order": self.order, "vocab_size": self.vocab_size}
        with open(path, "wb") as f:  # a file object: numpy would otherwise append ".npz" to the name
            np.savez(f, keys=self.keys, counts=self.counts, meta=np.array(json.dumps(meta)))

    @staticmethod
    def load(path: str | Path) -> NgramTable:
        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(
                f"n-gram table '{path}' not found: "
                f"build one with `specdec ngram build SOURCES --target MODEL -o {path}`"
            )
        try:
            with np.load(path) as data:
                meta = json.loads(str(data["meta"]))
                keys, counts = data["keys"], data["counts"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"'{path}' is not an n-gram table written by `specdec ngram build` ({exc})") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ConfigError(
                f"'{path}' is not a version-{VERSION} specdec n-gram table: rebuild it with `specdec ngram build`"
            )
        return NgramTable(keys, counts, meta["order"], meta["vocab_size"], meta)


class NgramDrafter(Drafter):
    """Copy from the context when it repeats itself (prompt lookup); otherwise continue from the corpus table.

    From the table it drafts greedily (the most frequent follower) while that
    follower's share of its context's counts is at least ``min_share``. When
    sampling, it draws each draft token from the followers' frequencies and
    hands the verifier that distribution, so rejection sampling stays exact
    with a non-degenerate draft (any q is exact if the token was drawn from it).
    """

    capabilities = DrafterCapabilities(trees=True)

    def __init__(self, table: NgramTable, min_share: float = 0.3) -> None:
        self.table = table
        self.vocab_size: int | None = table.vocab_size
        self.backend = None  # no model drafts
        self.min_share = min_share
        self.lookup = PromptLookupDrafter()
        self.settings = DraftSettings()

    def begin(self, settings: DraftSettings) -> None:
        self.settings = settings

    def accept(self, n: int) -> None:
        pass

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.table, self.min_share)  # shares the table; its settings are its own sequence's

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        # its copies (a tree of several with branches), else the table's chain
        copied = self.lookup.propose(context, k, branches)
        if len(copied):
            return copied
        sampling, min_confidence = self.settings.sampling, self.settings.min_confidence
        history = context[-self.table.order :].tolist()
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            followers, counts = self.table.longest_match(history)
            if not len(followers):
                break
            if sampling.greedy:
                best = int(counts.argmax())
                if counts[best] < max(self.min_share, min_confidence) * counts.sum():
                    break
                token = int(followers[best])
            else:
                if counts.max() < min_confidence * counts.sum():
                    break
                dist = torch.zeros(self.table.vocab_size)
                dist[torch.from_numpy(followers)] = torch.from_numpy(counts / counts.sum()).float()
                uniform = draft_uniform(self.settings.seeds, dist.device, len(context) + i)
                token = int(draw(dist[None], uniform=uniform))
                probs.append(dist)
            tokens.append(token)
            history = (history + [token])[-self.table.order :]
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None, steps=0)
