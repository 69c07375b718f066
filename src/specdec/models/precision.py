"""Precision plans: a number format per component of any transformers causal LM (attention, FFN, output head,
draft, the verifier's logits), applied in place.

Speculative greedy decoding reproduces one-token decoding only if a position's result does not depend on how many
positions are scored together, so a plan's attention and linear layers compute every position alike whatever the
others (``padded_eager_attention``, ``stable_rows``). docs/precision.md describes the formats and the kernels avoided.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from specdec.config import PRESETS, PrecisionPlan
from specdec.errors import ConfigError
from specdec.models.native import formats, kernel_build

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PADDED_ATTENTION = "specdec_padded_eager"
# Keys are padded to a multiple of this and weigh values this many at a time (float16 needs a multiple of 4).
KEY_BLOCK = 64
# Rows per 16-bit matmul call: with AMX, bfloat16 products of about 32 rows and more take a kernel that
# rounds rows otherwise.
ROW_BLOCK = 16


def padded_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention computed so that a query's result is the one it gets in one-token decoding: whatever the keys
    masked after it, the queries beside it, or (a tree of drafts) masked keys between the ones it sees.

    Inference only (plans convert a model for decoding): no dropout. Queries go ROW_BLOCK at a time (a lone one as
    two), over keys padded to a multiple of KEY_BLOCK; a query that sees other than one run of keys (a tree node) is
    weighed over just the keys it sees, laid out in order as in decoding (_attend's node groups).
    Shapes as transformers' attention functions: query [batch, heads, queries, dim], key/value
    [batch, kv_heads, keys, dim], an additive mask [batch, 1, queries, keys] or None.
    """
    groups = query.shape[1] // key.shape[1]
    keys = key.shape[2]
    pad = -keys % KEY_BLOCK
    key, kv_values = (F.pad(x, (0, 0, 0, pad)) for x in (key, value))  # kv_values: one per key-value head
    key, value = key.repeat_interleave(groups, dim=1), kv_values.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    given = (
        torch.zeros(1, 1, 1, 1, dtype=query.dtype, device=query.device) if attention_mask is None else attention_mask
    )
    mask = given.expand(query.shape[0], 1, query.shape[2], keys)  # broadcast dims made whole
    # Decoding (one query) and no mask: one run of keys.
    nodes = [] if query.shape[2] == 1 or attention_mask is None else _tree_nodes(attention_mask, mask)
    mask = F.pad(mask, (0, pad), value=torch.finfo(mask.dtype).min)
    parts = []
    for s in range(0, query.shape[2], ROW_BLOCK):
        rows, block_nodes = slice(s, s + ROW_BLOCK), [g for g in nodes if g.start == s]
        parts.append(_attend(query[:, :, rows], key, value, mask[:, :, rows], scale, softcap, block_nodes, kv_values))
    out, weights = torch.cat([o for o, _ in parts], dim=2), torch.cat([w for _, w in parts], dim=2)[..., :keys]
    return out.transpose(1, 2).contiguous(), weights


@dataclass(frozen=True)
class _NodeGroup:
    """The queries of one batch row and one ROW_BLOCK of queries that see other than one run of keys (tree nodes: their
    ancestors lie past masked siblings), with the keys each sees in order."""

    row: int
    start: int  # the first query of the block
    queries: torch.Tensor  # [nodes]: within the block
    keys: torch.Tensor  # [nodes, a multiple of KEY_BLOCK]: the keys each sees, in order, padded with key 0
    mask: torch.Tensor  # additive [nodes, keys]: the padding masked
    shared: int  # leading KEY_BLOCK blocks in which every node's keys are the row's keys as they lie (its prefix)


_LAYOUTS: list[tuple[weakref.ref, list[_NodeGroup]]] = []  # the last few masks' tree nodes, found by identity
LAYOUTS_KEPT = 4  # a forward passes one mask per attention kind (full, sliding) to every layer of that kind


def _tree_nodes(given: torch.Tensor, mask: torch.Tensor) -> list[_NodeGroup]:
    """The tree nodes of an additive mask [batch, 1, queries, keys] (``given``, expanded to ``mask``). Worked out once
    per mask: every layer of a kind reads the same mask tensor in a forward, so a forward reads the layout back to the
    host once, not once per layer."""
    for ref, groups in _LAYOUTS:
        if ref() is given:
            return groups
    seen = mask[:, 0] > torch.finfo(mask.dtype).min / 2  # [batch, queries, keys]
    # One run of keys (a prefix, or a sliding window) is laid out as in decoding; a tree node's path is not.
    first, last = seen.int().argmax(-1), seen.shape[-1] - 1 - seen.flip(-1).int().argmax(-1)
    count = seen.sum(-1)
    is_node = (count > 0) & (count < last - first + 1)  # [batch, queries]
    groups = []
    for row in is_node.any(-1).nonzero().flatten().tolist():
        for start in range(0, is_node.shape[1], ROW_BLOCK):
            queries = is_node[row, start : start + ROW_BLOCK].nonzero().flatten()
            if not len(queries):
                continue
            node_seen = seen[row, start + queries]
            lengths = node_seen.sum(-1)
            width = -int(lengths.max()) // KEY_BLOCK * -KEY_BLOCK
            order = torch.sort((~node_seen).to(torch.uint8), dim=-1, stable=True).indices  # seen keys first, in order
            order = F.pad(order, (0, max(0, width - order.shape[1])))[:, :width]
            inside = torch.arange(width, device=mask.device) < lengths[:, None]
            in_place = (order == torch.arange(width, device=mask.device)) | ~inside  # a key where decoding has it too
            shared = int(in_place.all(0).int().cumprod(0).sum()) // KEY_BLOCK
            padding = torch.zeros(inside.shape, dtype=mask.dtype, device=mask.device).masked_fill_(
                ~inside, torch.finfo(mask.dtype).min
            )
            groups.append(_NodeGroup(row, start, queries, order.where(inside, 0), padding, shared))
    _LAYOUTS[:] = [
        (weakref.ref(given), groups),
        *[entry for entry in _LAYOUTS if entry[0]() is not None][: LAYOUTS_KEPT - 1],
    ]
    return groups


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    nodes: list[_NodeGroup],
    kv_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of at most ROW_BLOCK queries, a lone one run as two, over keys (and a mask) padded to a multiple of
    KEY_BLOCK.

    Values are weighed one KEY_BLOCK of keys at a time and the parts summed in float32 in key order: a query's masked
    keys add exact zeros, so its result does not depend on how many keys the call has (one product over all of them
    would: AMX blocks by length). A tree node (``nodes``) is weighed as decoding weighs it: softmax over its keys in
    order (a query's score for a key is the same wherever the key lies, so the scores are gathered into that order), the
    blocks before the tree (``shared``) in the one product with the other queries, the rest over its own values,
    gathered from ``kv_values`` (the values before grouped-query heads repeat them: a quarter of the copying for 4 heads
    to one).
    """
    lone = query.shape[2] == 1
    if lone:
        query, mask = query.repeat(1, 1, 2, 1), mask.expand(-1, -1, 2, -1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(query.dtype)
    # A lone node is both rows of its pair.
    rows = [torch.arange(2, device=query.device) if lone else g.queries for g in nodes]
    # Per row: keys, padding.
    layouts = [(g.keys.repeat(2, 1), g.mask.repeat(2, 1)) if lone else (g.keys, g.mask) for g in nodes]
    in_order = []  # each group's weights over its keys in order [heads, nodes, width]
    for g, r, (order, padding) in zip(nodes, rows, layouts, strict=True):
        node_scores = scores[g.row][:, r].gather(-1, order.expand(scores.shape[1], -1, -1))
        in_order.append(F.softmax(node_scores + padding, dim=-1, dtype=torch.float32).to(query.dtype))
        weights[g.row][:, r] = F.pad(in_order[-1], (0, weights.shape[-1] - order.shape[1]))
    out: torch.Tensor | int = 0
    before_tree: dict[int, torch.Tensor] = {}  # per group: its nodes' sums over the blocks before the tree
    for b, k in enumerate(range(0, key.shape[2], KEY_BLOCK)):
        for i, g in enumerate(nodes):
            if b == g.shared:
                before_tree[i] = out[g.row][:, rows[i]] if isinstance(out, torch.Tensor) else 0  # type: ignore[assignment]
        out = out + torch.matmul(weights[..., k : k + KEY_BLOCK], value[:, :, k : k + KEY_BLOCK]).float()
    kv_heads, heads = kv_values.shape[1], query.shape[1]
    for i, g in enumerate(nodes):
        node_out, n = before_tree[i], len(g.queries)
        for k in range(g.shared * KEY_BLOCK, g.keys.shape[1], KEY_BLOCK):
            # Per node and key-value head: the weights of the heads sharing it [rows, block] times its values
            # [block, dim], the heads as rows of one product (a node alone as two rows, as decoding runs a lone query).
            gathered = (
                kv_values[g.row].index_select(1, g.keys[:, k : k + KEY_BLOCK].flatten()).unflatten(1, (n, KEY_BLOCK))
            )
            # [kv, n, heads/kv, block]
            node_weights = in_order[i][:, :n, k : k + KEY_BLOCK].unflatten(0, (kv_heads, -1)).transpose(1, 2)
            pair = node_weights.shape[2] == 1
            # [kv, n, rows, dim]
            part = torch.matmul(node_weights.repeat(1, 1, 2, 1) if pair else node_weights, gathered)
            part = (part[:, :, :1] if pair else part).transpose(1, 2).reshape(heads, n, -1)
            node_out = node_out + (part.repeat(1, 2, 1) if lone else part).float()
        out[g.row][:, rows[i]] = node_out  # type: ignore[index]
        # Its weights at the keys they weigh; padding points past the last key, cut off after.
        keys, padding = layouts[i]
        order = keys.masked_fill(padding < 0, weights.shape[-1])
        scattered = weights.new_zeros(heads, len(rows[i]), weights.shape[-1] + 1)
        weights[g.row][:, rows[i]] = scattered.scatter_(-1, order.expand(heads, -1, -1), in_order[i])[..., :-1]
    out = out.to(query.dtype)  # type: ignore[union-attr]
    return (out[:, :, :1], weights[:, :, :1]) if lone else (out, weights)


AttentionInterface.register(PADDED_ATTENTION, padded_eager_attention)
AttentionMaskInterface.register(PADDED_ATTENTION, eager_mask)  # additive masks, as eager attention reads them


def stable_rows(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``matmul`` over the rows of ``x`` [..., in], ROW_BLOCK rows at a time and a lone row as two, so every row goes
    through the same few-row kernel whatever the number of rows."""
    flat = x.reshape(-1, x.shape[-1])
    parts = [matmul(part) if part.shape[0] > 1 else matmul(part.repeat(2, 1))[:1] for part in flat.split(ROW_BLOCK)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class RowStableLinear(nn.Linear):
    """nn.Linear whose result for a row does not depend on how many rows come with it (see stable_rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stable_rows(lambda rows: F.linear(rows, self.weight, self.bias), x)


QUANTIZED = ("int8", "int8a8", "float8")


class QuantizedLinear(nn.Module):
    """A quantized linear layer: int8 or float8 weights, one scale per output channel (int8a8: int8 activations too)."""

    def __init__(self, linear: nn.Linear, fmt: str) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.format = fmt
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)
        )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if fmt == "int8a8":
            self.packed = formats.PackedInt8(weight)
            return
        if fmt == "int8":
            stored, scale = formats.quantize_rows(weight)
        else:
            scale = weight.abs().amax(dim=1).clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
            stored = (weight / scale[:, None]).to(torch.float8_e4m3fn)
        self.register_buffer("weight_q", stored)
        self.register_buffer("scale", scale.to(torch.bfloat16))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (a bfloat16 copy: for inspection and slicing rows, not for the forward pass)."""
        if self.format == "int8a8":
            return (self.packed.unpacked().float() * self.packed.scale.reshape(-1)[: self.out_features, None]).to(
                torch.bfloat16
            )
        return (self.weight_q.to(torch.bfloat16) * self.scale[:, None]).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "int8a8":  # integer products: no row depends on another, no stable_rows needed
            out = formats.linear(x, self.packed).to(torch.bfloat16)
            return out if self.bias is None else out + self.bias
        return stable_rows(self._matmul, x.to(torch.bfloat16))

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.format == "int8" and rows.device.type == "cpu":
            out = torch._weight_int8pack_mm(rows, self.weight_q, self.scale)
        else:  # dequantise: float8 everywhere, int8 off the CPU
            out = rows @ self.weight.T
        return out if self.bias is None else out + self.bias


# The precision each model converted here runs (a plan's description, or a draft's format), by model: a converted
# model takes no second plan, and its precision is part of its identity (loading.model_identity).
_CONVERTED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def precision_of(model: nn.Module) -> str | None:
    """The plan (its description) or draft format ``model`` was converted to here; None for a model not converted."""
    return _CONVERTED.get(model)


def share_precision(view: nn.Module, model: nn.Module) -> None:
    """Record that ``view``, made of ``model``'s own modules (a layerskip view), runs ``model``'s precision."""
    if (precision := precision_of(model)) is not None:
        _CONVERTED[view] = precision


def apply_plan(model: PreTrainedModel, plan: PrecisionPlan) -> PreTrainedModel:
    """Convert a target model, in place, to ``plan``; returns it."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        raise ConfigError(
            "precision plans need decoder layers with 'self_attn' and 'mlp' modules; "
            f"{type(model).__name__} has none: use --dtype instead"
        )
    converted = precision_of(model)
    if converted == plan.describe():
        return model  # already converted (a model shared between specdec and transformers' own methods)
    if converted is not None:
        raise ConfigError(f"this model already runs the precision plan {converted}: load it again for another plan")
    if "int8a8" in (plan.attention, plan.ffn, plan.head):
        kernel_build.compiled()  # a first use compiles the kernels: now, not inside the first request
    residual = torch.float32 if "float32" in (plan.attention, plan.ffn, plan.head) else torch.bfloat16
    _CONVERTED[model] = plan.describe()
    model.to(residual)
    if plan != PRESETS["fp32"]:
        model.set_attn_implementation(PADDED_ATTENTION)
    for layer in layers:
        _convert(layer.self_attn, plan.attention, residual)
        _convert(layer.mlp, plan.ffn, residual)
    head = model.get_output_embeddings()
    compute = _compute_dtype(plan.head)
    if plan.head in QUANTIZED:
        head = QuantizedLinear(head, plan.head)
    elif compute != residual:  # a copy: a tied embedding keeps the residual format
        weight = head.weight.detach().to(compute).clone()
        head = nn.Linear(head.in_features, head.out_features, bias=False, dtype=compute)
        head.weight = nn.Parameter(weight, requires_grad=False)
    if head is not model.get_output_embeddings():
        model.config.tie_word_embeddings = False
        model.set_output_embeddings(head)
    if compute != residual:
        head.register_forward_pre_hook(_cast_inputs(compute), with_kwargs=True)
    head.register_forward_hook(_cast_output(FLOAT_FORMATS[plan.verify]))  # the logits the verifier reads
    if plan.head in ("bfloat16", "float16"):
        head.__class__ = RowStableLinear
    return model


def convert_draft(draft: PreTrainedModel, fmt: str) -> PreTrainedModel:
    """A draft's own layers and head in ``fmt``; its embedding (perhaps the target's, shared) stays as it is."""
    residual = draft.get_input_embeddings().weight.dtype
    for layer in draft.model.layers:
        _convert(layer, fmt, residual)
    head = draft.get_output_embeddings()
    if fmt in QUANTIZED:
        head = QuantizedLinear(head, fmt)
        draft.set_output_embeddings(head)
    else:
        head.to(_compute_dtype(fmt))
    _hook_casts(head, _compute_dtype(fmt), residual)
    _CONVERTED[draft] = fmt
    return draft


def _compute_dtype(fmt: str) -> torch.dtype:
    return FLOAT_FORMATS.get(fmt, torch.bfloat16)


def _convert(module: nn.Module, fmt: str, residual: torch.dtype) -> None:
    compute = _compute_dtype(fmt)
    module.to(compute)
    _replace_linears(module, fmt)
    _hook_casts(module, compute, residual)


def _hook_casts(module: nn.Module, compute: torch.dtype, residual: torch.dtype) -> None:
    """Inputs into the component's format, outputs back into the residual stream's."""
    if compute != residual:
        module.register_forward_pre_hook(_cast_inputs(compute), with_kwargs=True)
        module.register_forward_hook(_cast_output(residual))


def _replace_linears(module: nn.Module, fmt: str) -> None:
    """Quantize the linear layers under ``module`` (int8, int8a8, float8) or make 16-bit ones row-stable."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and fmt in QUANTIZED:
            setattr(module, name, QuantizedLinear(child, fmt))
        elif isinstance(child, nn.Linear) and fmt in ("bfloat16", "float16"):
            child.__class__ = RowStableLinear  # same weights, same state-dict names
        else:
            _replace_linears(child, fmt)


def _cast(value: object, dtype: torch.dtype) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def _cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}  # type: ignore[return-value]

    return hook


def _cast_output(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, output: object) -> object:
        return _cast(output, dtype)

    return hook
