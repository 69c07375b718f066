"""Self-speculation: the target's own first L layers, then its final norm and output head, as the draft.

The view shares every weight tensor with the target, so the draft costs no
memory beyond its own KV cache; it runs through the ordinary model drafter,
which keeps that cache at the accepted prefix. A trained exit (a map and norm
fitted to layer L's hidden states, from ``specdec distill --arch exit=L``)
replaces the target's final norm when given.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError
from specdec.models.precision import share_precision


def shallow_view(model: PreTrainedModel, layers: int, exit_norm: nn.Module | None = None) -> PreTrainedModel:
    """``model`` cut after its first ``layers`` decoder layers; the modules are the target's own, not copies."""
    decoder = getattr(model, "model", None)
    stack = getattr(decoder, "layers", None)
    if not isinstance(stack, nn.ModuleList):
        raise ConfigError(f"layerskip needs a decoder-only model with model.layers; {type(model).__name__} has none")
    if not 1 <= layers < len(stack):
        raise ConfigError(f"layerskip:L needs 1 <= L < {len(stack)} (the target's layer count), got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    inner = copy.copy(decoder)
    inner._modules = dict(decoder._modules)  # a new module table: the target's own stays untouched
    inner.layers = nn.ModuleList(stack[:layers])
    inner.config = config
    if exit_norm is not None:
        inner.norm = exit_norm
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._buffers = dict(model._buffers)  # buffers registered on the view stay off the target
    view.model = inner
    view.config = config
    share_precision(view, model)  # its modules are the target's: so is the precision they run
    return view
