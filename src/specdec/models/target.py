"""A target as the engine sees it: a backend, a tokenizer, and the tokens that end generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdec.config import RuntimeConfig
from specdec.errors import ConfigError
from specdec.models.backend import Backend, TransformersBackend
from specdec.models.loading import LoadedModel, load_model
from specdec.models.precision import apply_plan
from specdec.models.registry import ALIASES, resolve


class Tokenizer(Protocol):
    """The part of a tokenizer the engine uses (transformers tokenizers fit it)."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> dict[str, list[int]]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Target:
    name: str
    backend: Backend
    tokenizer: Tokenizer | None
    eos_ids: frozenset[int]
    runtime: str = "transformers"  # the runtime it runs on: transformers, native or llama.cpp
    fallback: str | None = None  # why ``--backend auto`` did not choose native


def open_target(model: str | LoadedModel, runtime: RuntimeConfig = RuntimeConfig()) -> Target:
    """Open a model on a runtime: transformers (any causal LM), llama.cpp (GGUF files and bundled aliases), native
    (Gemma-3, Llama, Mistral and Qwen2/3 models on a CPU with AVX-512 VNNI) or auto (native where it runs, else
    transformers)."""
    if runtime.backend == "llama.cpp":
        from specdec.models.llamacpp import LlamaCppBackend

        name = model.name if isinstance(model, LoadedModel) else model
        backend = LlamaCppBackend(gguf_path(name), threads=runtime.threads, ubatch=runtime.ubatch)
        return Target(name, backend, backend.tokenizer, backend.eos_ids, runtime="llama.cpp")
    loaded = load_model(model, dtype="float32" if runtime.precision else runtime.dtype) if isinstance(model, str) else model
    fallback = None
    transformers_format = runtime.dtype != "float32" or runtime.precision is not None  # auto means transformers then
    if runtime.backend == "native" or (runtime.backend == "auto" and not transformers_format):
        from specdec.models import native

        fallback = native.unsupported(loaded.model)
        if fallback is None:
            try:
                backend = native.NativeBackend(native.NativeModel.from_module(loaded.model))
                return Target(loaded.name, backend, loaded.tokenizer, eos_ids(loaded), runtime="native")
            except (ConfigError, ValueError) as exc:  # a shape the native formats cannot hold
                fallback = f"the native backend cannot hold this model ({exc})"
        if runtime.backend == "native":
            raise ConfigError(fallback)
    if runtime.precision is not None:
        apply_plan(loaded.model, runtime.precision)
    return Target(loaded.name, TransformersBackend(loaded.model), loaded.tokenizer, eos_ids(loaded), fallback=fallback)


def gguf_path(name: str) -> str:
    """The GGUF file behind a model name, for runtimes that read GGUF directly."""
    source = resolve(name)
    if source.kind == "alias":
        return str(ALIASES[source.location].locate_gguf())
    if source.kind == "gguf":
        return source.location
    raise ConfigError(f"the llama.cpp backend reads GGUF files: '{name}' is a {source.kind}; pass a .gguf file or a bundled alias")


def eos_ids(model: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.model.generation_config, model.model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(model.tokenizer.eos_token_id)
    return frozenset(ids)
