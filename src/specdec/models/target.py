"""A target as the engine sees it: a backend, a tokenizer, and the tokens that end generation."""

from __future__ import annotations

from dataclasses import dataclass
from functools import singledispatch
from pathlib import Path
from typing import Protocol

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from specdec.config import RuntimeConfig
from specdec.errors import ConfigError, ModelNotFoundError
from specdec.models.backend import Backend
from specdec.models.loading import LoadedModel, first_line, load_model
from specdec.models.mkl import settle_mkl_functions
from specdec.models.precision import apply_plan
from specdec.models.registry import ALIASES, resolve
from specdec.models.transformers_backend import TransformersBackend


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
    fallback: str | None = None  # why ``--runtime auto`` did not choose native
    chosen: str | None = None  # how ``--native-format auto`` chose the native format


@singledispatch
def open_target(model: object, runtime: RuntimeConfig = RuntimeConfig()) -> Target:
    """Open a model on a runtime: transformers (any causal LM), llama.cpp (GGUF files and bundled aliases), native
    (Gemma-3, Llama, Mistral and Qwen2/3 models on a CPU with AVX2 or ARM SDOT) or auto (native where it runs, else
    transformers). One overload per declared model type: a name, a LoadedModel, or a Target already open (returned as
    it is); anything else is refused here."""
    raise ConfigError(f"a target is a model name, a LoadedModel or a Target, not {type(model).__name__}")


@open_target.register(Target)
def _opened(model: Target, runtime: RuntimeConfig = RuntimeConfig()) -> Target:
    return model


@open_target.register(str)
@open_target.register(LoadedModel)
def _open(model: str | LoadedModel, runtime: RuntimeConfig = RuntimeConfig()) -> Target:
    settle_mkl_functions()
    if runtime.backend == "llama.cpp":
        from specdec.models.llamacpp import LlamaCppBackend

        name = model if isinstance(model, str) else model.name
        backend = LlamaCppBackend(gguf_path(name), threads=runtime.threads, ubatch=runtime.ubatch)
        return Target(name, backend, backend.tokenizer, backend.eos_ids, runtime="llama.cpp")
    transformers_format = runtime.dtype != "float32" or runtime.precision is not None  # auto means transformers then
    fallback = None
    if runtime.backend == "native" or (runtime.backend == "auto" and not transformers_format):
        source = native_source(model) if isinstance(model, str) else None
        if source is not None:
            opened = _open_checkpoint(model, source, runtime.native_format)
        else:  # a hub id or a model in memory: the transformers model is loaded (once) and converted
            model = load_model(model) if isinstance(model, str) else model
            opened = _open_loaded(model, runtime.native_format)
        if not isinstance(opened, str):
            return opened
        fallback = opened
        if runtime.backend == "native":
            raise ConfigError(fallback)
    loaded = (
        load_model(model, dtype="float32" if runtime.precision else runtime.dtype) if isinstance(model, str) else model
    )
    if runtime.precision is not None:
        apply_plan(loaded.model, runtime.precision)
    return Target(loaded.name, TransformersBackend(loaded.model), loaded.tokenizer, eos_ids(loaded), fallback=fallback)


def _open_checkpoint(name: str, source: Path, format: str) -> Target | str:
    """The target on the native runtime from a local checkpoint (a safetensors folder or a GGUF file), loaded (or
    memory-mapped from the converted cache) one tensor at a time without building the transformers model; or why it
    cannot run there."""
    from specdec.models import native
    from specdec.models.native import formats, store

    folder = store.gguf_metadata(source) if source.suffix == ".gguf" else source  # config and tokenizer
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelNotFoundError(f"could not read the config of '{name}' in {folder}: {first_line(exc)}") from None
    text = config.get_text_config()
    if (problem := native.unsupported(text)) is not None:
        return problem
    try:
        format, chosen = formats.choose_format(text, format)
        weights = store.load(source, text, format)
    except (ConfigError, ValueError) as exc:  # a shape the native formats cannot hold, a damaged file
        return f"the native backend cannot hold this model ({exc})"
    tokenizer = _tokenizer(folder)
    ids = _eos_from(config, _generation_config(folder), tokenizer)
    return Target(name, native.NativeBackend(weights), tokenizer, ids, runtime="native", chosen=chosen)


def _open_loaded(loaded: LoadedModel, format: str) -> Target | str:
    """The target on the native runtime from a transformers model in memory, or why it cannot run there."""
    from specdec.models import native
    from specdec.models.native import formats

    if next(loaded.model.parameters()).device.type != "cpu":
        return "the native backend runs on the CPU: use --runtime transformers on other devices"
    text = loaded.model.config.get_text_config()
    if (problem := native.unsupported(text)) is not None:
        return problem
    try:
        format, chosen = formats.choose_format(text, format)
        weights = native.NativeModel.from_module(loaded.model, format)
    except (ConfigError, ValueError) as exc:
        return f"the native backend cannot hold this model ({exc})"
    ids = eos_ids(loaded)
    return Target(loaded.name, native.NativeBackend(weights), loaded.tokenizer, ids, runtime="native", chosen=chosen)


def native_source(name: str) -> Path | None:
    """The local checkpoint behind a model name that the native runtime reads tensor by tensor: a GGUF file (bundled
    aliases too) or a safetensors folder; None for a hub id."""
    source = resolve(name)
    if source.kind == "hub":
        return None
    if source.kind in ("alias", "gguf"):
        return Path(gguf_path(name))
    folder = Path(source.location)
    return folder if any(folder.glob("*.safetensors")) and (folder / "config.json").exists() else None


def _tokenizer(folder: Path):
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None  # a weights-only folder still works with token ids


def _generation_config(folder: Path):
    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):
        return None


def gguf_path(name: str) -> str:
    """The GGUF file behind a model name, for runtimes that read GGUF directly."""
    source = resolve(name)
    if source.kind == "alias":
        return str(ALIASES[source.location].locate_gguf())
    if source.kind == "gguf":
        return source.location
    raise ConfigError(
        f"the llama.cpp backend reads GGUF files: '{name}' is a {source.kind}; pass a .gguf file or a bundled alias"
    )


def eos_ids(model: LoadedModel) -> frozenset[int]:
    return _eos_from(model.model.config, model.model.generation_config, model.tokenizer)


def _eos_from(config, generation_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (generation_config, config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
