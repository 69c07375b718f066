"""Long-generation quality measurements: how far text drifts, repeats or differs (guards are in specdec.guards)."""

from specdec.quality.embedding import SentenceEmbedder

__all__ = ["SentenceEmbedder"]
