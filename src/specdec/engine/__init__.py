"""The decode engine: the speculative loop and the Generator API around it."""

from specdec.engine.generator import GenerationResult, Generator
from specdec.engine.loop import DecodeStats, speculative_decode

__all__ = ["DecodeStats", "GenerationResult", "Generator", "speculative_decode"]
