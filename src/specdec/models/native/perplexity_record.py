"""The native runtime's perplexity against float32, as stored once measured.

`specdec doctor --target NAME` measures it (bench/perplexity.py's ``native_perplexity``, on the shipped default
prompts) and stores it here, keyed by the backend's ``identity`` (model, weights, format, kernels' build) and the
packed files' version (a changed quantizer is a new version); what `generate` and `demo` say of the runtime reads
the stored figure and never measures.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.atomic import PUBLIC, atomic_write_bytes
from specdec.models.native.store import STORE_VERSION  # the packed weights' version: their numbers, too
from specdec.models.registry import cache_root

CHECK_TOKENS = 1024  # of the shipped default prompt set: enough to tell a sound int8 model from a broken one
CHECK_MAX_WEIGHTS = 2 * 10**9  # larger models are not measured unasked (float32 copies of tens of GB)


@dataclass(frozen=True)
class PerplexityResult:
    plan: str
    perplexity: float
    float32_perplexity: float
    tokens: int

    @property
    def delta(self) -> float:
        return self.perplexity - self.float32_perplexity


def record_path(identity: str) -> Path:
    """Where the check of the native backend ``identity`` is stored."""
    key = hashlib.sha256(f"{identity}|{CHECK_TOKENS}|{STORE_VERSION}".encode()).hexdigest()[:16]
    return cache_root() / "perplexity" / f"native-{key}.json"


def stored_check(identity: str) -> PerplexityResult | None:
    """The stored check of the native backend ``identity``; None where none was measured (or the record is damaged)."""
    try:
        return PerplexityResult(**json.loads(record_path(identity).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def store_check(identity: str, result: PerplexityResult) -> None:
    """Keep ``result`` as the check of the native backend ``identity`` (written whole or not at all)."""
    path = record_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(asdict(result)).encode(), PUBLIC)


def describe(result: PerplexityResult) -> str:
    """The check in words, as the runtime's announcement and `doctor` say it."""
    share = result.delta / result.float32_perplexity
    return (
        f"perplexity {result.perplexity:.3f} against float32 {result.float32_perplexity:.3f}, {share:+.2%}, "
        f"on {result.tokens:,} tokens"
    )
