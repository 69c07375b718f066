"""The decode engine: the speculative loop and the Generator API around it."""

from specdec.engine.batch import BatchDecoder, Row
from specdec.engine.generator import Completion, GenerationResult, Generator
from specdec.engine.loop import DecodeStats, speculative_decode

__all__ = ["BatchDecoder", "Completion", "DecodeStats", "GenerationResult", "Generator", "Row", "speculative_decode"]
