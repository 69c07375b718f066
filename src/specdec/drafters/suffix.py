"""Suffix drafting: continue the context with what followed its longest match, in this request and in earlier ones.

Prompt lookup copies from the current request only. In agent loops, tool calls and
structured extraction, the answer is mostly in *earlier answers*: the same function
skeletons, JSON keys, SQL clauses. A :class:`SuffixStore` keeps the outputs of
finished sequences (bounded: the oldest leave first) and an index of their n-grams;
a :class:`SuffixDrafter` looks up the context's last tokens there and in its own
request, and proposes the continuations that followed most often (recent ones
weighing more), as a tree scored by their frequency or, asked for a chain, their
likeliest path. The longer the match, the deeper it drafts.

The store's index is a few sorted uint64 arrays (hashes of every window of each
order in ``ORDERS``, with positions), so a lookup costs a binary search per array
however many tokens are cached, and memory is about 8 + 16 * len(ORDERS) bytes per
token. Hash collisions only make a draft worse, never the output: the target verifies
every token, and siblings are distinct tokens, so sampled verification stays exact.

Sharing changes only speed, never content; but speed can tell one user whether
others asked alike, so each sequence names a ``scope`` (DraftSettings): it reads and
feeds only the history of its own scope (HistoryScope: everyone's, one group's, or none).
"""

from __future__ import annotations

import io
import json
import math
import threading
import zipfile
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from specdec.atomic import atomic_write
from specdec.drafters.base import (
    EVERYONE,
    Drafter,
    DrafterCapabilities,
    DraftSettings,
    HistoryScope,
    Proposal,
    TokenTrie,
)
from specdec.drafters.ngram import MASK64, PRIME
from specdec.errors import ConfigError

ORDERS = (1, 2, 3, 4, 6, 8, 12, 16)  # n-gram lengths indexed; in each source the longest that matches decides
CANDIDATES = 32  # most recent matches read per source (the request, the store)
DEPTH_PER_MATCH = 8.0  # a match of n tokens drafts at most this many times n tokens (and k)
# the history's match wins only when longer than this many times the sequence's own: what a text said itself predicts
# it better than what other texts said after a somewhat longer shared context (other answers, other samples); an own
# match of 4 tokens or more always wins (16 is the longest order)
OWN_WEIGHT = 4
MIN_SCORE = 0.1  # a node followed by less than this share of the matches (by weight) is not drafted
RECENCY = 0.8  # the i-th most recent match weighs RECENCY**i: text repeats what it said last most
MAX_SEGMENTS = 8  # index segments before the smallest are merged
FORMAT, VERSION = "specdec-suffix", 1
DEFAULT_MAX_TOKENS = 1_000_000
LEAD_IN = ORDERS[-1]  # prompt tokens kept before each output
NPY_HEADER = 4096  # the most bytes a saved array's .npy header takes (numpy's are about a hundred)
SCOPE_CHARS = 64  # room, per kept sequence, for its scope's name in a saved cache (a server's names have 32)


class DamagedCacheError(ConfigError):
    """A suffix cache file that cannot be read back (torn, truncated, corrupted): not a choice of the user's, so a
    server moves it aside and starts empty rather than refusing to start."""


_SALTS = {n: (0x9E3779B97F4A7C15 * n) & MASK64 for n in ORDERS}  # each order its own keys


def _tail_hashes(tokens: Sequence[int], end: int) -> list[int]:
    """The hash of the window of each n in ORDERS (that fits) ending at ``tokens[end]``, in one pass backwards."""
    hashes, h, n = [], 0, 0
    for order in ORDERS:
        if order > end + 1:
            break
        while n < order:
            h = (h * PRIME + tokens[end - n] + 1) & MASK64
            n += 1
        hashes.append(h ^ _SALTS[order])
    return hashes


def _window_hashes(tokens: np.ndarray, order: int) -> np.ndarray:
    """:func:`_tail_hashes`' hash of every window of ``order`` tokens in ``tokens``, by the window's last token."""
    windows = len(tokens) - order + 1
    if windows <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(windows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(order):
            h = h * np.uint64(PRIME) + tokens[order - 1 - j : order - 1 - j + windows].astype(np.uint64) + np.uint64(1)
    return h ^ np.uint64(_SALTS[order])


@dataclass(frozen=True)
class _Segment:
    """Sorted window hashes over some sequences, with the position of each window's last token; its positions span
    ``low..high`` (the sequences it indexes lie one after another)."""

    keys: np.ndarray  # uint64, sorted
    positions: np.ndarray  # int64, ascending within equal keys
    low: int
    high: int

    @staticmethod
    def build(tokens: np.ndarray, start: int, salt: int = 0) -> _Segment:
        """The index of one sequence whose first token sits at global position ``start``; ``salt`` is mixed into its
        keys (the store's scope number: a lookup never sees another scope's windows)."""
        keys, positions = [], []
        for order in ORDERS:
            if len(tokens) > order:  # a window needs a token after it to be worth finding
                keys.append(_window_hashes(tokens[:-1], order) ^ np.uint64(salt))
                positions.append(np.arange(start + order - 1, start + len(tokens) - 1, dtype=np.int64))
        if not keys:
            return _Segment(np.zeros(0, np.uint64), np.zeros(0, np.int64), start, start)
        keys_, positions_ = np.concatenate(keys), np.concatenate(positions)
        order = np.lexsort((positions_, keys_))
        return _Segment(keys_[order], positions_[order], start, start + len(tokens) - 1)

    @staticmethod
    def merge(segments: Sequence[_Segment]) -> _Segment:
        """One segment of ``segments``, oldest first: a stable sort of sorted runs is a linear merge."""
        keys = np.concatenate([s.keys for s in segments])
        order = np.argsort(keys, kind="stable")
        positions = np.concatenate([s.positions for s in segments])[order]
        return _Segment(keys[order], positions, min(s.low for s in segments), max(s.high for s in segments))

    def after(self, floor: int) -> _Segment:
        """The windows that end at ``floor`` or later."""
        live = self.positions >= floor
        return _Segment(self.keys[live], self.positions[live], max(self.low, floor), self.high)

    def find(self, queries: np.ndarray, limit: int) -> list[np.ndarray]:
        """For each query hash, the positions of its last ``limit`` windows (the most recent), oldest first."""
        bounds = self.keys.searchsorted(np.concatenate([queries, queries + np.uint64(1)]))
        lows, highs = bounds[: len(queries)], bounds[len(queries) :]
        return [self.positions[max(low, high - limit) : high] for low, high in zip(lows, highs, strict=True)]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.positions.nbytes


def _salt(owner: int) -> int:
    """What a scope number mixes into its windows' keys (0 for the first scope)."""
    return (owner * 0xD6E8FEB86659FD93) & MASK64


class SuffixStore:
    """The outputs of finished sequences, per scope, at most ``max_tokens`` of them (the oldest leave first, whatever
    their scope), with an index of their n-grams. Safe to share between threads; adding costs about the added
    sequence, not the store (segments merge geometrically, evicted windows are skipped until half a segment is dead)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 0:
            raise ConfigError(f"the suffix store's size must be 0 or more tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._tokens = np.zeros(1024, np.int32)  # every kept sequence, each followed by -1; grows by doubling
        self._owners = np.zeros(1024, np.int32)  # the scope number of each token
        self._used = 0  # entries of _tokens in use
        self._base = 0  # the global position of _tokens[0]
        self._sequences: deque[tuple[int, int]] = deque()  # (global start, global end) of each kept sequence
        self._segments: list[_Segment] = []
        self._scopes: dict[str, int] = {}
        self._count = 0  # tokens kept
        self._nbytes = 0  # memory held, updated by add (read without the lock)
        self._added = 0  # sequences added since the start

    @property
    def token_count(self) -> int:
        return self._count

    @property
    def changes(self) -> int:
        """How many sequences were added to this store: equal counts, the same content (a saver's test for whether
        to write again)."""
        return self._added

    @property
    def nbytes(self) -> int:
        """Memory held: the tokens, their scopes and the index (as of the last add)."""
        return self._nbytes

    def add(self, tokens: Sequence[int] | np.ndarray, scope: str = "") -> None:
        """Keep ``tokens`` (one finished sequence's output) for later sequences of ``scope``."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) < 2 or len(tokens) > self.max_tokens:
            return  # nothing to copy from, or more than the whole store
        with self._lock:
            owner = self._scopes.setdefault(scope, len(self._scopes))
            self._append(tokens, owner)
            start = self._base + self._used - len(tokens) - 1
            self._sequences.append((start, start + len(tokens)))
            self._count += len(tokens)
            self._added += 1
            self._segments.append(_Segment.build(tokens, start, _salt(owner)))
            self._evict()
            self._compact_index()
            self._nbytes = self._tokens.nbytes + self._owners.nbytes + sum(s.nbytes for s in self._segments)

    def _append(self, tokens: np.ndarray, owner: int) -> None:
        need = self._used + len(tokens) + 1
        if need > len(self._tokens):
            size = max(need, 2 * len(self._tokens))
            self._tokens = np.concatenate([self._tokens[: self._used], np.zeros(size - self._used, np.int32)])
            self._owners = np.concatenate([self._owners[: self._used], np.zeros(size - self._used, np.int32)])
        self._tokens[self._used : need - 1] = tokens
        self._tokens[need - 1] = -1
        self._owners[self._used : need] = owner
        self._used = need

    def _evict(self) -> None:
        while self._count > self.max_tokens:
            start, end = self._sequences.popleft()
            self._count -= end - start
        floor = self._floor
        kept = []
        for segment in self._segments:
            if segment.high < floor:
                continue  # wholly evicted
            if segment.low < floor and (floor - segment.low) * 2 > segment.high - segment.low:
                segment = segment.after(floor)  # mostly evicted: lookups skip the rest until then
            kept.append(segment)
        self._segments = kept
        dead = floor - self._base
        if dead * 2 > self._used:  # move the live tokens to the front
            live = self._used - dead
            self._tokens[:live], self._owners[:live] = self._tokens[dead : self._used], self._owners[dead : self._used]
            self._used, self._base = live, floor

    @property
    def _floor(self) -> int:
        """The global position of the oldest kept token."""
        return self._sequences[0][0] if self._sequences else self._base + self._used

    def _compact_index(self) -> None:
        """Merge the newest segments while they are as large as the one before (sizes stay geometric), and the
        smallest two while there are too many."""
        while len(self._segments) > 1 and len(self._segments[-1]) * 2 >= len(self._segments[-2]):
            self._segments[-2:] = [_Segment.merge(self._segments[-2:])]
        while len(self._segments) > MAX_SEGMENTS:
            self._segments[-2:] = [_Segment.merge(self._segments[-2:])]

    def matches(self, tail: Sequence[int], scope: str, length: int = 64) -> tuple[int, list[list[int]]]:
        """(n, continuations): for the longest n in ORDERS whose last n tokens of ``tail`` occurred in ``scope``'s
        history, the ``length`` tokens that followed each of its CANDIDATES most recent occurrences, the latest first
        (fewer at a sequence's end); (0, []) when none matches."""
        return self.lookup(_tail_hashes(tail, len(tail) - 1), scope, length)

    def lookup(
        self, queries: list[int], scope: str, length: int, limit: int = CANDIDATES
    ) -> tuple[int, list[list[int]]]:
        """:meth:`matches` for the hashes of the tail's windows (:func:`_tail_hashes`), computed once per step."""
        with self._lock:
            owner = self._scopes.get(scope)
            if owner is None or not self._segments or not queries:
                return 0, []
            keys = np.array(queries, dtype=np.uint64) ^ np.uint64(_salt(owner))
            found = [segment.find(keys, 2 * limit) for segment in self._segments]
            floor = self._floor
            for i in reversed(range(len(queries))):
                positions = np.concatenate([f[i] for f in found])
                positions = positions[positions >= floor]
                positions = positions[self._owners[positions - self._base] == owner]  # a hash collision across scopes
                if len(positions):
                    return ORDERS[i], self._continuations(np.sort(positions)[-limit:][::-1], length)
            return 0, []

    def _continuations(self, positions: np.ndarray, length: int) -> list[list[int]]:
        offsets = positions[:, None] - self._base + 1 + np.arange(length)
        windows = self._tokens[np.minimum(offsets, self._used - 1)]
        windows = np.where(offsets < self._used, windows, -1)
        runs = []
        for window in windows.tolist():
            end = window.index(-1) if -1 in window else length
            runs.append(window[:end])
        return runs

    def save(self, path: str | Path, model: str) -> None:
        """Write the kept sequences (not the index: it is rebuilt on load) for ``model``'s tokenizer, readable by its
        owner only (it holds users' answers), whole or not at all (a save stopped at any point leaves the previous
        file as it was). The state is copied under the lock, so lookups and adds go on while the file is written."""
        with self._save_lock:  # saves one at a time: the last snapshot taken is the last written
            with self._lock:
                spans = np.array(self._sequences, dtype=np.int64).reshape(-1, 2)
                # copies: the buffer changes in place once the lock is released
                parts = [self._tokens[s - self._base : e - self._base] for s, e in spans]
                flat = np.concatenate(parts or [np.zeros(0)]).astype(np.int32)
                numbers = [int(self._owners[s - self._base]) for s, _ in spans]
                names = sorted(self._scopes, key=self._scopes.__getitem__)
            kept = sorted(set(numbers))  # the scopes that still own a sequence, numbered afresh
            renumber = {number: i for i, number in enumerate(kept)}
            owners = np.array([renumber[n] for n in numbers], dtype=np.int32)
            lengths = (spans[:, 1] - spans[:, 0]).astype(np.int64)
            meta = {"format": FORMAT, "version": VERSION, "model": model, "scopes": [names[n] for n in kept]}
            meta["checksum"] = zlib.crc32(flat.tobytes() + lengths.tobytes() + owners.tobytes())
            atomic_write(
                path,
                lambda out: np.savez(out, meta=np.array(json.dumps(meta)), tokens=flat, lengths=lengths, owners=owners),
            )

    @classmethod
    def load(cls, path: str | Path, model: str, vocab_size: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> SuffixStore:
        """A store with the sequences saved in ``path``; ConfigError (one line) for a file that is not a suffix cache
        of ``model``, holds tokens outside the vocabulary, or more than ``max_tokens`` (or the default size, if larger)
        allows, refused before it inflates; DamagedCacheError for one that cannot be read back."""
        fix = f"delete it or pass another --suffix-cache (the server rewrites it as it runs): {path}"
        limits = _member_limits(max_tokens)
        try:
            arrays = _read_arrays(path, limits)
            meta = json.loads(str(arrays["meta"]))
            flat, lengths, owners = arrays["tokens"], arrays["lengths"], arrays["owners"]
        except FileNotFoundError:
            raise
        except PermissionError:
            raise ConfigError(f"cannot read the suffix cache {path}: give this process read access to it") from None
        except _TooLarge as exc:
            raise ConfigError(
                f"the suffix cache {path} is larger than --suffix-max-tokens {max_tokens} allows ({exc}): "
                "raise --suffix-max-tokens, or delete it"
            ) from None
        except _UNREADABLE as exc:
            raise DamagedCacheError(f"not a specdec suffix cache ({type(exc).__name__}): {fix}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ConfigError(f"not a specdec suffix cache: {fix}")
        if meta.get("version") != VERSION:
            raise ConfigError(
                f"a suffix cache of format version {meta.get('version')}, this specdec reads {VERSION}: {fix}"
            )
        if meta.get("model") != model:
            raise ConfigError(f"a suffix cache of another model ({meta.get('model')}, not {model}): {fix}")
        shapes_ok = (
            flat.dtype == np.int32
            and lengths.dtype == np.int64
            and owners.dtype == np.int32
            and lengths.ndim == owners.ndim == flat.ndim == 1
            and len(lengths) == len(owners)
            and int(lengths.sum()) == len(flat)
            and (lengths >= 0).all()
        )
        checksum = zlib.crc32(flat.tobytes() + lengths.tobytes() + owners.tobytes()) if shapes_ok else None
        scopes = meta.get("scopes")
        scopes_ok = isinstance(scopes, list) and all(isinstance(scope, str) for scope in scopes)
        if not shapes_ok or checksum != meta.get("checksum") or not scopes_ok:
            raise DamagedCacheError(f"a damaged suffix cache: {fix}")
        tokens_bad = len(flat) and (flat.min() < 0 or flat.max() >= vocab_size)
        if tokens_bad or len(owners) and (owners.min() < 0 or owners.max() >= len(scopes)):
            raise ConfigError(f"a suffix cache with tokens or scopes out of range: {fix}")
        store = cls(max_tokens)
        for tokens, owner in zip(np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else [], owners, strict=True):
            store.add(tokens, scopes[owner])
        return store


# What reading a damaged archive raises: a torn or corrupted zip, a member encrypted or compressed in a way zipfile
# does not read, a malformed .npy or JSON header.
_UNREADABLE = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    EOFError,
    RecursionError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)


class _TooLarge(Exception):
    """A cache member that would inflate past its limit (the message: which, and how large)."""


def _member_limits(max_tokens: int) -> dict[str, int]:
    """The most bytes each member of a cache can inflate to when a store of ``max_tokens`` wrote it, or one of the
    default size if larger (so that a cache written at the default size, like `specdec ngram build`'s, loads into a
    smaller store, keeping its newest): every kept sequence has 2 tokens or more and brings at most one scope."""
    tokens = max(max_tokens, DEFAULT_MAX_TOKENS)
    sequences = tokens // 2
    return {
        "meta.npy": NPY_HEADER + 4 * (NPY_HEADER + (SCOPE_CHARS + 4) * sequences),  # 4 bytes per character
        "tokens.npy": NPY_HEADER + 4 * tokens,
        "lengths.npy": NPY_HEADER + 8 * sequences,
        "owners.npy": NPY_HEADER + 4 * sequences,
    }


def _read_arrays(path: str | Path, limits: dict[str, int]) -> dict[str, np.ndarray]:
    """The arrays of the .npz at ``path`` by name, which must be those of ``limits``; a member whose size (as its
    header declares it, and as it inflates: a header may lie) passes its limit raises _TooLarge before more of it is
    read."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        if sorted(m.filename for m in members) != sorted(limits):
            raise KeyError(f"members {[m.filename for m in members][:8]}")
        arrays = {}
        for member in members:
            limit = limits[member.filename]
            if member.file_size > limit:
                raise _TooLarge(f"{member.filename} inflates to {member.file_size:,} bytes, at most {limit:,}")
            with archive.open(member) as stream:
                raw = stream.read(limit + 1)
            if len(raw) > limit:
                raise _TooLarge(f"{member.filename} inflates past {limit:,} bytes")
            arrays[member.filename.removesuffix(".npy")] = _npy_array(raw)
    return arrays


def _npy_array(raw: bytes) -> np.ndarray:
    """The array in an .npy file's bytes, whose data must be exactly the size its header declares (numpy's own reader
    allocates the declared size before reading)."""
    stream = io.BytesIO(raw)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f".npy format version {version}")
    count, start = math.prod(shape), stream.tell()
    if dtype.hasobject or len(shape) > 1 or count * dtype.itemsize != len(raw) - start:
        raise ValueError("an array whose data does not match its header")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=start).reshape(shape)


class _RequestIndex:
    """The current sequence's own windows: its prompt's in a segment, then those of its output as it grows."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # the sequence so far, extended by what each step adds
        self.prompt: _Segment | None = None
        self.positions: dict[int, list[int]] = {}  # windows ending in the output (and the prompt's last token)
        self.indexed = 0  # windows ending before this position are in

    def extend(self, context: torch.Tensor) -> list[int]:
        """The sequence as a list, converting only the tokens added since the last step (``context`` continues it);
        indexed."""
        self.tokens += context[len(self.tokens) :].tolist()
        self.update(self.tokens)
        return self.tokens

    def update(self, context: list[int]) -> None:
        """Index every window of ``context`` that a token follows."""
        if self.prompt is None:
            self.prompt = _Segment.build(np.asarray(context, dtype=np.int64), 0)
            self.indexed = len(context) - 1
        for end in range(self.indexed, len(context) - 1):
            for h in _tail_hashes(context, end):
                self.positions.setdefault(h, []).append(end)
        self.indexed = max(self.indexed, len(context) - 1)

    def matches(
        self, context: list[int], queries: list[int], length: int, limit: int = CANDIDATES
    ) -> tuple[int, list[list[int]]]:
        """Like :meth:`SuffixStore.matches`, within ``context`` itself."""
        in_prompt = self.prompt.find(np.array(queries, dtype=np.uint64), limit) if self.prompt is not None else None
        for i in reversed(range(len(queries))):
            ends = ([] if in_prompt is None else in_prompt[i].tolist()) + self.positions.get(queries[i], [])
            if ends:
                return ORDERS[i], [context[end + 1 : end + 1 + length] for end in reversed(ends[-limit:])]
        return 0, []


class SuffixDrafter(Drafter):
    """Drafts what followed the context's longest match in this sequence and in the ``store``'s history of its scope.

    Forks share the store; each sequence adds its output to it when it ends (``finish``).
    """

    capabilities = DrafterCapabilities(trees=True, scores=True, learns=True)
    vocab_size = None
    backend = None  # no model drafts

    def __init__(self, store: SuffixStore | None = None) -> None:
        self.store = store if store is not None else SuffixStore()
        self.scope: HistoryScope = EVERYONE
        self._own = _RequestIndex()

    def begin(self, settings: DraftSettings) -> None:
        self.scope = settings.scope
        self._own = _RequestIndex()

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.store)

    def finish(self, tokens: torch.Tensor, prompt_length: int) -> None:
        """Keep the output, led in by the prompt's last tokens (so the step from a prompt to its answer matches)."""
        history = self.scope.history
        if history is not None and len(tokens) > prompt_length:  # no output (cancelled at once): nothing to keep
            self.store.add(tokens[max(0, prompt_length - LEAD_IN) :].numpy(), history)

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        """Up to ``k`` nodes: the continuations of the longest match in this sequence (or in the store, when its
        match is more than OWN_WEIGHT times longer), merged into a tree where each node scores the share of matches it
        continues, the recent ones weighing more; with one branch, the likeliest path as a chain, without scores (a
        share of few matches understates how often a copy comes true: the k policy sizes chains from the acceptance
        it measures)."""
        if len(context) < len(self._own.tokens):  # not a continuation of this sequence: start over
            self._own = _RequestIndex()
        tokens = self._own.extend(context)
        queries = _tail_hashes(tokens, len(tokens) - 1) if tokens else []
        n_own, own = self._own.matches(tokens, queries, k)
        history = self.scope.history
        n_store, stored = (0, []) if history is None else self.store.lookup(queries, history, k)
        n, runs = (n_own, own) if n_own * OWN_WEIGHT >= n_store else (n_store, stored)
        if not runs:
            return Proposal(context[:0], steps=0)
        depth = min(k, max(1, round(DEPTH_PER_MATCH * n)))
        tree = _scored_tree(runs, depth, k, branches)
        return tree if branches > 1 else replace(tree, scores=None)


def _scored_tree(runs: list[list[int]], depth: int, budget: int, branches: int) -> Proposal:
    """The runs' (most recent first) first ``depth`` tokens as a trie where a node's score is the share of runs
    through it, run i weighing RECENCY**i; nodes below MIN_SCORE, beyond ``branches`` children of one node or beyond
    ``budget`` nodes are left out; best first."""
    trie, weights = TokenTrie(), []
    for i, run in enumerate(runs):
        parent, weight = -1, RECENCY**i
        for token in run[:depth]:
            node = trie.find(parent, token)
            if node is None:
                node = trie.add(parent, token)
                weights.append(0.0)
            weights[node] += weight
            parent = node
    total = sum(RECENCY**i for i in range(len(runs)))
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(trie.parents):
        children.setdefault(parent, []).append(node)
    kept: list[int] = []  # best first: a parent scores at least its children and comes before them
    frontier = sorted(children.get(-1, []), key=lambda c: -weights[c])[:branches]
    while frontier and len(kept) < budget:
        best = max(frontier, key=lambda c: (weights[c], -c))
        frontier.remove(best)
        if weights[best] < MIN_SCORE * total:
            break  # the frontier's best: every other node scores less
        kept.append(best)
        frontier += sorted(children.get(best, []), key=lambda c: -weights[c])[:branches]
    number = {node: i for i, node in enumerate(kept)}
    return Proposal(
        torch.tensor([trie.tokens[node] for node in kept], dtype=torch.long),
        parents=None
        if branches == 1
        else torch.tensor([number.get(trie.parents[node], -1) for node in kept], dtype=torch.long),
        scores=torch.tensor([min(1.0, weights[node] / total) for node in kept]),
        steps=0,
    )
