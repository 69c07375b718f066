"""torch's MKL-backed elementwise functions, each called once on one thread before a server's threads call them."""

from __future__ import annotations

from functools import cache

import torch

# ATen's float and double unary operations that call MKL's vector math library (ATen/cpu/vml.h)
MKL_FUNCTIONS = (
    torch.acos, torch.asin, torch.atan, torch.cos, torch.erf, torch.erfc, torch.erfinv, torch.exp, torch.log,
    torch.log10, torch.log2, torch.sin, torch.sqrt, torch.tan, torch.tanh, torch.trunc,
)  # fmt: skip


@cache
def settle_torch_functions() -> None:
    """Call each of MKL_FUNCTIONS once, on a tensor too small to be split among threads, in float32 and float64: once a
    process, in the thread that opens a target. MKL chooses each function's kernel at its first call; where that call
    runs on several threads at once (a large tensor's shares, or a server's engine and request threads at its first
    request), one thread can compute its share with a low-accuracy kernel (cos seen off by 1e-4 here), and a result
    kept (the native runtime's rotary table) stays wrong. After a first call on one thread, every later call agrees."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((16,), 0.5, dtype=dtype)
        for function in MKL_FUNCTIONS:
            function(x)
