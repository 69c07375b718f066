"""Model loading and the backends through which the engine runs a model."""

from specdec.models.backend import Backend
from specdec.models.loading import LoadedModel, load_model, parse_dtype
from specdec.models.registry import ALIASES, DEFAULT_TARGET, ModelSource, resolve
from specdec.models.target import Target, Tokenizer, open_target
from specdec.models.transformers_backend import TransformersBackend

__all__ = [
    "ALIASES",
    "DEFAULT_TARGET",
    "Backend",
    "LoadedModel",
    "ModelSource",
    "Target",
    "Tokenizer",
    "TransformersBackend",
    "load_model",
    "open_target",
    "parse_dtype",
    "resolve",
]
