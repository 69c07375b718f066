"""Drafters: cheap proposers of candidate tokens, all behind one protocol."""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.model import ModelDrafter
from specdec.drafters.none import NoDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import ConfigError
from specdec.models import TransformersBackend, load_model

DRAFT_SPECS = "none, prompt-lookup, model:MODEL"


def build_drafter(spec: str, dtype: str | torch.dtype = "float32") -> Drafter:
    """Build a drafter from its command-line spec (see DRAFT_SPECS)."""
    if spec == "none":
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    if spec.startswith("model:") and spec[len("model:") :]:
        return ModelDrafter(TransformersBackend(load_model(spec[len("model:") :], dtype=dtype).model))
    raise ConfigError(f"unknown draft '{spec}': use one of {DRAFT_SPECS}")


__all__ = ["DRAFT_SPECS", "Drafter", "ModelDrafter", "NoDrafter", "PromptLookupDrafter", "Proposal", "build_drafter"]
