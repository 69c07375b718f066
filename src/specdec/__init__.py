"""specdec: lossless speculative decoding for LLM text generation."""

from specdec.config import GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.engine import DecodeStats, GenerationResult, Generator
from specdec.errors import SpecDecError
from specdec.profile import Profile

__all__ = [
    "DecodeStats",
    "GenerationConfig",
    "GenerationResult",
    "Generator",
    "Profile",
    "RuntimeConfig",
    "SamplingConfig",
    "SpecDecError",
]
__version__ = "0.1.0"
