"""Long-generation quality: guards applied while decoding, and the measurements that judge them."""

from specdec.quality.embedding import SentenceEmbedder
from specdec.quality.guards import Guards, Loop, NoGuards, find_loop, ignorable_tokens

__all__ = ["Guards", "Loop", "NoGuards", "SentenceEmbedder", "find_loop", "ignorable_tokens"]
