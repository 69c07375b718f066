"""The cost of one target forward over n tokens, measured on this machine and runtime.

Whether speculating k tokens pays depends on how the price of verifying k + 1
tokens compares with one token: nearly flat for transformers in bfloat16 here,
steep for llama.cpp. k policies and the benchmark read this curve instead of assuming it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time

import torch

from specdec.models.backend import Backend
from specdec.models.registry import cache_root
from specdec.scheduling import CostCurve

DEFAULT_SIZES = (1, 2, 3, 5, 9, 13, 17)  # k + 1 for k = 0, 1, 2, 4, 8, 12, 16


def forward_cost_curve(backend: Backend, sizes: tuple[int, ...] = DEFAULT_SIZES, context: int = 64, repeats: int = 5) -> dict[int, float]:
    """Median seconds of a forward over n new tokens (logits for all n) after ``context`` cached tokens."""
    vocab = backend.vocab_size
    tokens = torch.arange(context + max(sizes), dtype=torch.long)[None] % vocab
    backend.reset()
    backend.forward(tokens[:, :context], last=1)
    backend.forward(tokens[:, context : context + 1], last=1)  # warm-up
    backend.truncate(context)
    curve = {}
    for n in sizes:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.forward(tokens[:, context : context + n], last=n)
            times.append(time.perf_counter() - start)
            backend.truncate(context)
        curve[n] = statistics.median(times)
    backend.reset()
    return curve


def machine_cost_curve(backend: Backend) -> CostCurve:
    """This backend's cost curve on this machine: measured once (a few seconds), then read from the cache."""
    key = f"{platform.node()}|{platform.processor() or platform.machine()}|{backend.identity}"
    path = cache_root() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        stored = json.loads(path.read_text())
        return CostCurve({int(n): s for n, s in stored["seconds"].items()})
    seconds = forward_cost_curve(backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "seconds": seconds}, indent=1))
    return CostCurve(seconds)
