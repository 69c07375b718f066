"""The native runtime's kernels besides the linear layers: attention over the paged KV cache, row-wise RMS norms, the
rotary position embedding and the MLP's gated activation; each computes a position alone, so its bits do not depend
on the positions beside it. Also a grammar's packed token mask applied to logits (``forbid``)."""

from __future__ import annotations

import torch

from specdec.models.native import kernel_build
from specdec.models.native.paged_cache import PAGE, PagedCache


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedCache,
    layer: int,
    start: int,
    window: int,
    scale: float,
    visible: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [n, heads, dim] over ``layer``'s cached keys and values and the new ones k, v [n, kv_heads, dim],
    which are written into the cache at start..start+n-1 first; window 0 = all keys.

    ``visible`` None: the new positions are a chain (start..start+n-1); a bool [n, n] mask: a tree, node i seeing
    the new nodes j where it is True (itself and its ancestors), at ``positions[i]`` in the text (start + its depth).
    """
    kernel = _compiled("attention")
    kernel_build.on_cpu(q, k, v)
    if k.shape[1:] != (cache.kv_heads, cache.head_dim) or v.shape != k.shape:
        raise ValueError(
            f"keys {tuple(k.shape)} and values {tuple(v.shape)} do not fit the cache's pages "
            f"([n, {cache.kv_heads}, {cache.head_dim}])"
        )
    chain = visible is None  # the kernel reads empty tensors as a chain
    mask = torch.empty(0, dtype=torch.uint8) if chain else visible.to(torch.uint8).contiguous()
    where = torch.empty(0, dtype=torch.long) if chain else positions.to(torch.long).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tables = cache.tables
    kind = cache.kind
    return kernel_build.call(kernel.attention, q, k, v, tables, layer, kind, PAGE, start, window, scale, mask, where)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dimension, float32, each row alone."""
    kernel = _compiled("norm")
    kernel_build.on_cpu(x, weight)
    return kernel_build.call(kernel.rms_norm, x.contiguous(), weight, eps)


def gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for rows [n, 2f] (gate first): SiLU, or GELU's tanh form; each value alone, whatever the rows
    or threads (a float32 approximation of its own, within a few units in the last place of torch's)."""
    kernel = _compiled("activation")
    kernel_build.on_cpu(gate_up)
    return kernel_build.call(kernel.gated, gate_up.contiguous(), 1 if gelu else 0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [n, heads, dim] by cos and sin [n, 1, dim] (each position's): ``x * cos +
    rotate_half(x) * sin``, bit for bit torch's formula (three IEEE operations per value), in one call."""
    kernel = _compiled("rotary")
    kernel_build.on_cpu(x, cos, sin)
    return kernel_build.call(kernel.rope, x.contiguous(), cos, sin)


def forbid(logits: torch.Tensor, bits: torch.Tensor, width: int) -> None:
    """Set to -inf, in place, each ``logits[r, t]`` (t < ``width``) whose bit t of row r of ``bits`` is 0 (int32
    words, bit t % 32 of word t // 32: a grammar's token mask); the other values are left as they are."""
    kernel = _compiled("mask")
    kernel_build.on_cpu(logits, bits)
    kernel_build.call(kernel.forbid, logits, bits, width)


def forbid_reference(logits: torch.Tensor, bits: torch.Tensor, width: int) -> None:
    """``forbid`` by torch's operations: the test oracle, and the path where the kernels are not loaded."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :width].bool().to(logits.device)
    logits[:, :width].masked_fill_(~allowed, float("-inf"))


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotate``'s numbers from torch's operations (transformers' rotate_half form): the test oracle, and the way a
    benchmark compares against."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _compiled(what: str):
    kernel = kernel_build.compiled()
    if kernel is None:
        raise RuntimeError(f"the {what} kernel is not built on this machine")
    return kernel
