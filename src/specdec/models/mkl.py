"""torch's MKL-backed elementwise functions, each called once on one thread before threads share them."""

from __future__ import annotations

import threading
from functools import cache

import torch

# ATen's float and double unary operations that call MKL's vector math library (ATen/cpu/vml.h)
MKL_FUNCTIONS = (
    torch.acos, torch.asin, torch.atan, torch.cos, torch.erf, torch.erfc, torch.erfinv, torch.exp, torch.log,
    torch.log10, torch.log2, torch.sin, torch.sqrt, torch.tan, torch.tanh, torch.trunc,
)  # fmt: skip

_settling = threading.Lock()


def settle_mkl_functions() -> None:
    """Call each of MKL_FUNCTIONS once on 16 values (too few to be split among threads), in float32 and float64, once a
    process: MKL picks a function's kernel at its first call, and a first call on several threads at once can compute a
    share with a low-accuracy kernel; every later call agrees."""
    with _settling:  # a second caller waits for the first calls to end
        _settle()


@cache
def _settle() -> None:
    for dtype in (torch.float32, torch.float64):
        values = torch.full((16,), 0.5, dtype=dtype)
        for function in MKL_FUNCTIONS:
            function(values)
