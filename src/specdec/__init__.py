"""specdec: lossless speculative decoding for LLM text generation."""

from specdec.config import GenerationConfig, SamplingConfig
from specdec.engine import DecodeStats, GenerationResult, Generator
from specdec.errors import SpecDecError

__all__ = ["DecodeStats", "GenerationConfig", "GenerationResult", "Generator", "SamplingConfig", "SpecDecError"]
__version__ = "0.1.0"
