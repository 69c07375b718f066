"""Measurements of long outputs: repetition, loops, diversity, topic drift and a contradiction proxy.

Token-level measures work on any model's ids; drift and the contradiction
proxy read text through a sentence-embedding model (SentenceEmbedder).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specdec.config import GuardConfig
from specdec.guards import find_loop
from specdec.quality.embedding import SentenceEmbedder

NEGATIONS = frozenset("not no never none nobody nothing neither nor cannot without".split())
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Unique n-grams over all n-grams (1.0: nothing repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated_ngram_share(tokens: Sequence[int], n: int = 4, start: int = 0, end: int | None = None) -> float:
    """Share of the n-grams starting in [start, end) that already occurred earlier in ``tokens``."""
    end = len(tokens) - n + 1 if end is None else min(end, len(tokens) - n + 1)
    seen = {tuple(tokens[i : i + n]) for i in range(start)}
    repeated = 0
    for i in range(start, end):
        gram = tuple(tokens[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated / (end - start) if end > start else 0.0


def looping(
    tokens: Sequence[int], guards: GuardConfig = GuardConfig(), ignorable: frozenset[int] = frozenset()
) -> list[bool]:
    """For each prefix length 1..len(tokens): whether the output up to there ends in a loop."""
    return [
        find_loop(tokens[:i], guards.loop_repeats, guards.loop_min_span, guards.loop_max_unit, ignorable) is not None
        for i in range(1, len(tokens) + 1)
    ]


def loop_onsets(
    tokens: Sequence[int], guards: GuardConfig = GuardConfig(), ignorable: frozenset[int] = frozenset()
) -> list[int]:
    """Positions where the output starts ending in a loop (find_loop turns from None to a loop)."""
    return onsets(looping(tokens, guards, ignorable))


def onsets(flags: list[bool]) -> list[int]:
    """Prefix lengths at which ``looping`` turns true."""
    return [i + 1 for i, now in enumerate(flags) if now and (i == 0 or not flags[i - 1])]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if len(s.strip().split()) >= 3]


def negated(sentence: str) -> bool:
    words = re.findall(r"[a-z']+", sentence.lower())
    return any(w in NEGATIONS or w.endswith("n't") for w in words)


def contradiction_pairs(
    embedder: SentenceEmbedder, text: str, min_similarity: float = 0.8
) -> list[tuple[str, str, float]]:
    """Sentence pairs that say nearly the same thing (cosine >= min_similarity) where exactly one is negated.

    A proxy: it finds "X is Y" against "X is not Y" stated in similar words. It
    cannot see contradictions in different words, numeric or factual conflicts,
    or conflicts with the prompt or the world; a negation that does not flip the
    meaning ("not only ... but also") is a false alarm.
    """
    found = sentences(text)
    if len(found) < 2:
        return []
    vectors = embedder.embed(found)
    similarity = vectors @ vectors.T
    pairs = []
    for i in range(len(found)):
        for j in range(i + 1, len(found)):
            if similarity[i, j] >= min_similarity and negated(found[i]) != negated(found[j]):
                pairs.append((found[i], found[j], round(float(similarity[i, j]), 3)))
    return pairs


@dataclass
class QualityReport:
    """The measures of one output; the curves have one value per window of ``window`` tokens."""

    tokens: int
    repeated_4gram_share: float
    distinct_1: float
    distinct_2: float
    loop_onsets: list[int]
    looping_share: float  # share of output positions at which the output so far ends in a loop
    repetition_curve: list[float]  # per window: share of its 4-grams seen before in the output
    drift_curve: list[float]  # per window: cosine similarity to the prompt
    contradictions: list[tuple[str, str, float]]

    @property
    def drift_mean(self) -> float:
        return sum(self.drift_curve) / len(self.drift_curve) if self.drift_curve else 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"drift_mean": self.drift_mean}


def measure(
    prompt: str,
    tokens: Sequence[int],
    decode,
    embedder: SentenceEmbedder,
    window: int = 100,
    ignorable: frozenset[int] = frozenset(),
) -> QualityReport:
    """Every measure of one output ``tokens`` of ``prompt``; ``decode`` turns ids into text."""
    bounds = [(start, min(start + window, len(tokens))) for start in range(0, len(tokens), window)]
    bounds = [(a, b) for a, b in bounds if b - a >= window // 2]  # a short last window says little
    texts = [decode(list(tokens[a:b])) for a, b in bounds]
    flags = looping(tokens, ignorable=ignorable)
    return QualityReport(
        tokens=len(tokens),
        repeated_4gram_share=round(repeated_ngram_share(tokens), 4),
        distinct_1=round(distinct_n(tokens, 1), 4),
        distinct_2=round(distinct_n(tokens, 2), 4),
        loop_onsets=onsets(flags),
        looping_share=round(sum(flags) / len(flags), 4) if flags else 0.0,
        repetition_curve=[round(repeated_ngram_share(tokens, 4, a, b), 4) for a, b in bounds],
        drift_curve=[round(s, 4) for s in embedder.similarity(prompt, texts)] if texts else [],
        contradictions=contradiction_pairs(embedder, decode(list(tokens))),
    )
