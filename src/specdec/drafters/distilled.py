"""Distilled drafts: a few transformer layers in the target's family with a reduced-vocabulary head.

Two kinds share the format. ``layers`` drafts own a few layers initialised from
the target's; ``exit`` drafts are the target's own first L layers (shared,
frozen: the self-speculative drafter) with a trained exit, a linear map and a
norm fitted to layer L's hidden states.


The draft borrows the target's (frozen) input embedding and predicts only the
N most frequent target tokens, with the target's own output-embedding rows for
those tokens as its head; so its own weights are just its layers and final
norm, and its cost does not scale with the target's vocabulary. Its
distribution over the full vocabulary is zero outside those N tokens, which
keeps the verifier exact. A draft folder holds ``config.json`` (a transformers
config), ``model.safetensors`` (layers, norm, kept token ids) and
``specdec_draft.json`` (what it was distilled from and how).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specdec.drafters.layer_skip import shallow_view
from specdec.errors import ConfigError
from specdec.models.backend import BackendCapabilities, OneRow, RowBackend
from specdec.models.transformers_backend import TransformersBackend

DRAFT_META = "specdec_draft.json"


def is_distilled_draft(path: str | Path) -> bool:
    return (Path(path) / DRAFT_META).is_file()


def build_draft(target: PreTrainedModel, layer_ids: list[int], keep_ids: torch.Tensor) -> PreTrainedModel:
    """A draft whose layers start as copies of the target's ``layer_ids``, on the target's embedding."""
    stack = target.model.layers
    if not layer_ids or not all(0 <= i < len(stack) for i in layer_ids):
        raise ConfigError(f"draft layers must be indices of the target's {len(stack)} layers, got {layer_ids}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layer_ids)
    if getattr(config, "layer_types", None):
        config.layer_types = [target.config.layer_types[i] for i in layer_ids]
    config.vocab_size = len(keep_ids)
    config.tie_word_embeddings = False
    draft = AutoModelForCausalLM.from_config(config).to(device=target.device, dtype=target.dtype)
    for mine, theirs in zip(draft.model.layers, (stack[i] for i in layer_ids), strict=True):
        mine.load_state_dict(theirs.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    attach_target(draft, target, keep_ids)
    return draft.eval()


def build_exit_draft(target: PreTrainedModel, layers: int, keep_ids: torch.Tensor) -> PreTrainedModel:
    """The target's first ``layers`` layers (shared) with a trainable exit (identity map + the target's final norm)."""
    hidden = target.config.hidden_size
    adapter = nn.Linear(hidden, hidden, bias=False, dtype=target.dtype, device=target.device)
    with torch.no_grad():
        adapter.weight.copy_(torch.eye(hidden))
    exit_norm = nn.Sequential(adapter, copy.deepcopy(target.model.norm))
    view = shallow_view(target, layers, exit_norm=exit_norm)
    for p in view.parameters():
        p.requires_grad_(False)
    attach_target(view, target, keep_ids)
    for p in exit_norm.parameters():
        p.requires_grad_(True)
    return view.eval()


def attach_target(draft: PreTrainedModel, target: PreTrainedModel, keep_ids: torch.Tensor) -> None:
    """Give the draft the target's embedding (shared, frozen) and a head of the target's rows for ``keep_ids``."""
    if target.config.hidden_size != draft.config.hidden_size:
        raise ConfigError(
            f"this draft has hidden size {draft.config.hidden_size} but the target has {target.config.hidden_size}: "
            "use it with the target it was distilled from"
        )
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.embed_tokens.weight.requires_grad_(False)
    rows = target.get_output_embeddings().weight.detach()[keep_ids].clone()
    draft.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
    draft.lm_head.weight = nn.Parameter(rows, requires_grad=False)
    draft.register_buffer("keep_ids", keep_ids.to(rows.device, copy=True), persistent=False)


def own_parameters(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The weights a draft folder stores and training updates: every parameter not borrowed (frozen) from the target."""
    return {name: p for name, p in draft.named_parameters() if p.requires_grad}


def save_draft(draft: PreTrainedModel, folder: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``draft`` into ``folder`` with ``meta`` (what read_meta returns; ``meta["arch"]["eagle"]`` marks an eagle
    head)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(folder)
    stored = own_parameters(draft)
    # an eagle head keeps its output rows: it may run where the target's full head is not at hand
    if meta.get("arch", {}).get("eagle"):
        stored["lm_head.weight"] = draft.lm_head.weight
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in stored.items()}
    save_file(tensors | {"keep_ids": draft.keep_ids.to(torch.int64)}, str(folder / "model.safetensors"))
    (folder / DRAFT_META).write_text(json.dumps(meta, indent=1))


def read_meta(folder: str | Path) -> dict:
    """How a draft was distilled, and its calibrated ``min_confidence`` (0 when the folder predates calibration)."""
    return json.loads((Path(folder) / DRAFT_META).read_text())


def load_draft(folder: str | Path, target: PreTrainedModel) -> PreTrainedModel:
    """A saved draft on ``target``'s embedding, in the target's dtype and on its device."""
    folder = Path(folder)
    meta = read_meta(folder)
    config = AutoConfig.from_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    keep_ids = tensors.pop("keep_ids")
    if int(keep_ids.max()) >= target.get_output_embeddings().weight.shape[0]:
        raise ConfigError(
            f"draft '{folder}' was distilled for '{meta.get('target')}', whose vocabulary differs from this target's"
        )
    if meta.get("arch", {}).get("exit"):
        draft = build_exit_draft(target, meta["arch"]["exit"], keep_ids)
    else:
        draft = AutoModelForCausalLM.from_config(config).to(device=target.device, dtype=target.dtype)
        attach_target(draft, target, keep_ids)
    own = set(own_parameters(draft))
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k in own]
    if missing or unexpected:
        raise ConfigError(
            f"draft '{folder}' does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return draft.eval()


class ReducedVocabBackend(TransformersBackend):
    """A draft backend whose logits over N kept tokens are spread over the target's vocabulary (-inf elsewhere)."""

    def __init__(self, model: PreTrainedModel, full_vocab: int) -> None:
        super().__init__(model)
        self.keep_ids = model.keep_ids
        # logits over the target's vocabulary; a drafting model: chains of one sequence, no hidden states
        self.info = replace(self.info, vocab_size=full_vocab, capabilities=BackendCapabilities())

    def fork(self) -> ReducedVocabBackend:
        return ReducedVocabBackend(self.model, self.vocab_size)

    def row_backend(self, *, batch: bool, trees: bool = False, cuda_graphs: bool = True) -> RowBackend:
        return OneRow(self.fork() if batch else self)

    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        if tree is not None or features:
            raise ConfigError("a reduced-vocabulary draft scores chains and returns no hidden states")
        reduced = super().forward(tokens, last)
        full = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.keep_ids] = reduced
        return full
