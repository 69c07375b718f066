"""torch's CPU threads, started before a server's threads use them."""

from __future__ import annotations

from functools import cache

import torch


@cache
def start_torch_threads() -> None:
    """Run one parallel torch operation in this thread (the one that opens a target), once a process. When two threads
    start their first parallel operations at once, as a server's engine and request threads do at its first request,
    torch on the CPU can compute one thread's share of an elementwise operation with other results (cos, exp and tanh
    seen off by up to 1e-4); once a parallel operation has run, every later one agrees."""
    torch.exp(torch.zeros(torch.get_num_threads() << 15 | 1))  # a share for every thread (grains of 32768)
