"""The decode engine: one speculative step, the row lifecycle every driver uses, and the Generator API around them."""

from specdec.engine.completion import Completion, GenerationResult
from specdec.engine.decoder import Decoder, Sink, Update
from specdec.engine.generator import Generator
from specdec.engine.rows import Row
from specdec.engine.stats import DecodeStats
from specdec.engine.step import speculative_step
from specdec.verification.logprobs import TokenLogprob

__all__ = [
    "Completion",
    "DecodeStats",
    "Decoder",
    "GenerationResult",
    "Generator",
    "Row",
    "Sink",
    "TokenLogprob",
    "Update",
    "speculative_step",
]
