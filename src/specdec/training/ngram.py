"""Build an n-gram table from text: stream the corpus, tokenize with the target's tokenizer, count, prune.

Memory stays bounded whatever the corpus size: counts are merged in batches and,
whenever the table outgrows twice its limit, the rarest entries are dropped
(lossy counting: a pruned n-gram that keeps recurring is counted again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.drafters.ngram import NgramTable, context_hashes, vocab_bits
from specdec.errors import ConfigError, PromptError

TEXT_SUFFIXES = frozenset(
    (
        ".txt .md .rst .py .js .ts .java .c .h .cc .cpp .hpp .go .rs .rb .php .sh .html .css .json .yaml .yml .toml "
        ".csv .tex .sql"
    ).split()
)
JSONL_TEXT_FIELDS = ("prompt", "continuation", "completion", "response", "text")
CHUNK_CHARS = 1 << 16  # plain text is tokenized in pieces of about this size, cut at line ends
MERGE_EVERY = 1 << 21  # n-gram occurrences collected before merging them into the table
BYTES_PER_ENTRY = 12  # uint64 key + uint32 count


@dataclass(frozen=True)
class NgramBuildConfig:
    order: int = 4  # longest context, in tokens
    max_mb: float = 64.0  # size limit of the saved table

    def __post_init__(self) -> None:
        if not 1 <= self.order <= 16:
            raise ConfigError(f"order (longest context) must be between 1 and 16, got {self.order}")
        if self.max_mb <= 0:
            raise ConfigError(f"max_mb must be > 0, got {self.max_mb}")

    @property
    def max_entries(self) -> int:
        return max(1, int(self.max_mb * 2**20 / BYTES_PER_ENTRY))


def corpus_files(sources: list[str]) -> list[Path]:
    """Every file to read: named files as they are, folders searched for text, code and JSONL files."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            files += sorted(
                p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.suffix == ".jsonl")
            )
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"corpus source '{source}' does not exist: pass text files, folders or JSONL files")
    if not files:
        raise ConfigError(
            f"no text files found in {', '.join(sources)} (looked for {', '.join(sorted(TEXT_SUFFIXES))}, .jsonl)"
        )
    return files


def jsonl_records(path: Path) -> Iterator[tuple[dict, int]]:
    """The JSON objects of a JSONL file, each with its line's size in bytes; a bad line is an error naming it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if isinstance(record, dict):
                yield record, len(line.encode("utf-8"))


def record_text(record: dict) -> str:
    """A JSONL record's text: its prompt followed by its continuation (whichever fields it has)."""
    return "".join(str(record[key]) for key in JSONL_TEXT_FIELDS if key in record)


def documents(path: Path) -> Iterator[tuple[str, int]]:
    """Pieces of text of one file, each with the bytes of the file it used (for progress)."""
    if path.suffix == ".jsonl":
        yield from ((record_text(record), size) for record, size in jsonl_records(path))
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        while piece := f.read(CHUNK_CHARS):
            piece += f.readline()  # end at a line break
            yield piece, len(piece.encode("utf-8"))


class NgramCounter:
    """Counts (context, next token) pairs for contexts of 1..order tokens, within a bounded size."""

    def __init__(self, order: int, vocab_size: int, max_entries: int) -> None:
        self.order = order
        self.vocab_size = vocab_size
        self.bits = vocab_bits(vocab_size)
        self.max_entries = max_entries
        self.keys = np.empty(0, dtype=np.uint64)
        self.counts = np.empty(0, dtype=np.uint64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self.tokens = 0

    def add(self, tokens: list[int]) -> None:
        ids = np.asarray(tokens, dtype=np.int64)
        self.tokens += len(ids)
        for n in range(1, self.order + 1):
            if len(ids) <= n:
                break
            contexts = context_hashes(ids[:-1], n)  # every window that has a token after it
            keys = (contexts >> np.uint64(self.bits)) << np.uint64(self.bits) | ids[n:].astype(np.uint64)
            self._pending.append(keys)
            self._pending_size += len(keys)
        if self._pending_size >= MERGE_EVERY:
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        fresh = np.concatenate(self._pending)
        keys = np.concatenate([self.keys, fresh])
        weights = np.concatenate([self.counts, np.ones(len(fresh), dtype=np.uint64)])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=weights).astype(np.uint64)
        self._pending, self._pending_size = [], 0
        if len(self.keys) > 2 * self.max_entries:
            self._prune(self.max_entries)

    def _prune(self, size: int) -> None:
        """Keep the ``size`` most frequent entries (in key order)."""
        keep = np.sort(np.argpartition(self.counts, len(self.counts) - size)[len(self.counts) - size :])
        self.keys, self.counts = self.keys[keep], self.counts[keep]

    def table(self, meta: dict) -> NgramTable:
        self._merge()
        if len(self.keys) > self.max_entries:
            self._prune(self.max_entries)
        counts = np.minimum(self.counts, np.iinfo(np.uint32).max).astype(np.uint32)
        return NgramTable(
            self.keys, counts, self.order, self.vocab_size, meta | {"tokens": self.tokens, "entries": len(self.keys)}
        )


def build_ngram_table(
    sources: list[str],
    tokenize: Callable[[list[str]], list[list[int]]],
    vocab_size: int,
    config: NgramBuildConfig,
    meta: dict,
    progress: Callable[[int, int], None] = lambda done, total: None,
    keep: Callable[[list[int]], None] | None = None,
) -> NgramTable:
    """Count the n-grams of every source; ``progress(bytes_done, bytes_total)`` follows the reading; ``keep`` is
    given every piece's tokens too (a suffix store seeded from the same corpus)."""
    files = corpus_files(sources)
    total = sum(f.stat().st_size for f in files)
    counter = NgramCounter(config.order, vocab_size, config.max_entries)
    done = 0
    batch: list[str] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal done, batch, batch_bytes
        for ids in tokenize(batch):
            counter.add(ids)
            if keep is not None:
                keep(ids)
        done += batch_bytes
        progress(done, total)
        batch, batch_bytes = [], 0

    for path in files:
        for text, size in documents(path):
            batch.append(text)
            batch_bytes += size
            if len(batch) >= 64:
                flush()
    if batch:
        flush()
    if counter.tokens == 0:
        raise ConfigError(f"the corpus ({', '.join(sources)}) holds no text to count")
    return counter.table(meta | {"sources": [str(f) for f in files], "bytes": total, "max_mb": config.max_mb})
