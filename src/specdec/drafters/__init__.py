"""Drafters: cheap proposers of candidate tokens, all behind one protocol."""

from __future__ import annotations

from dataclasses import replace

from specdec.config import RuntimeConfig
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.model import ModelDrafter
from specdec.drafters.none import NoDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import ConfigError
from specdec.models import open_target

DRAFT_SPECS = "none, prompt-lookup, model:MODEL (transformers), gguf:MODEL (llama.cpp)"


def build_drafter(spec: str, runtime: RuntimeConfig = RuntimeConfig()) -> Drafter:
    """Build a drafter from its command-line spec (see DRAFT_SPECS); model drafts share the target's runtime settings."""
    kind, _, model = spec.partition(":")
    if spec == "none":
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    if kind in ("model", "gguf") and model:
        backend = "transformers" if kind == "model" else "llama.cpp"
        return ModelDrafter(open_target(model, replace(runtime, backend=backend)).backend)
    raise ConfigError(f"unknown draft '{spec}': use one of {DRAFT_SPECS}")


__all__ = ["DRAFT_SPECS", "Drafter", "ModelDrafter", "NoDrafter", "PromptLookupDrafter", "Proposal", "build_drafter"]
