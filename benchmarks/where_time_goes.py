"""Where a target forward's time goes on this machine, per runtime, against the memory-bandwidth roofline (issue 23).

Usage: python benchmarks/where_time_goes.py [--out FILE] [--runtimes float32,bfloat16,cpu,cpu-vnni,native,llama.cpp]

1. This machine's memory bandwidth: a read-only pass (a sum) and a copy (read + write) over 1 GiB, best of 5.
2. For each runtime, the weight bytes one step reads (every parameter once; for llama.cpp the GGUF's tensor data),
   hence the one-token roofline: bytes / bandwidth.
3. A forward over n = 1, 2, 5, 9, 17 new tokens after 64 cached ones (median of 7), logits for every position.
   transformers: split by forward hooks into the output head, attention (projections, rotary, the product),
   MLP, norms, embedding, and the rest (the framework's Python, the cache's bookkeeping) = the unhooked
   total minus the hooked components. llama.cpp: the same forward with logits at the last position only;
   the difference is what computing the output head at every position costs. native: each of its kernels
   timed as it is called (the output head, the other linear layers, attention, norms) within the forwards (mean
   of 7, "hooked_total"); the rest of those is torch's small operations (rotary, activations, residual adds) and Python.
4. specdec's own bookkeeping per step (drafting aside): wall time of prompt-lookup generations minus their
   prefill, drafting and target forwards, per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec import Generator
from specdec.bench.prompts import load_prompts
from specdec.config import PrecisionPlan, RuntimeConfig
from specdec.models import open_target
from specdec.models.native import formats, ops
from specdec.models.target import gguf_path

SIZES = (1, 2, 5, 9, 17)
CONTEXT = 64
REPEATS = 7
RUNTIMES = {
    "float32": RuntimeConfig(dtype="float32"),
    "bfloat16": RuntimeConfig(dtype="bfloat16"),
    "cpu": RuntimeConfig(precision=PrecisionPlan.parse("cpu")),
    "cpu-vnni": RuntimeConfig(precision=PrecisionPlan.parse("cpu-vnni")),
    "native": RuntimeConfig(backend="native"),
    "llama.cpp": RuntimeConfig(backend="llama.cpp"),
}


def bandwidth() -> dict[str, float]:
    """GB/s of a read-only pass and of a copy over 1 GiB (best of 5: the machine's, not a scheduling hiccup's)."""
    x = torch.ones(2**28, dtype=torch.float32)
    y = torch.empty_like(x)
    reads, copies = [], []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        reads.append(x.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        y.copy_(x)
        copies.append(2 * x.nbytes / (time.perf_counter() - start) / 1e9)
    return {"read_GBps": max(reads), "copy_GBps": max(copies)}


def _category(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if last == "lm_head":
        return "head"
    if last == "self_attn":
        return "attention"
    if last == "mlp":
        return "mlp"
    if last == "embed_tokens":
        return "embedding"
    if "norm" in last or "rotary" in last:
        return "norms/rotary"
    return None


class _Hooks:
    """Forward hooks that add each component's wall time
    (outermost matching module only: q_norm inside attention is attention's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        claimed: list[str] = []
        for name, module in model.named_modules():
            kind = _category(name)
            if kind is None or any(name.startswith(c + ".") for c in claimed):
                continue
            claimed.append(name)
            self.handles.append(module.register_forward_pre_hook(self._start))
            self.handles.append(module.register_forward_hook(self._stop(kind)))

    def _start(self, module: torch.nn.Module, args: object) -> None:
        module._specdec_started = time.perf_counter()

    def _stop(self, kind: str):
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            self.seconds[kind] += time.perf_counter() - module._specdec_started

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _timed(backend, n: int, last: int) -> float:
    tokens = torch.arange(CONTEXT + n, dtype=torch.long)[None] % backend.vocab_size
    times = []
    for _ in range(REPEATS):
        backend.reset()
        backend.forward(tokens[:, :CONTEXT], last=1)
        start = time.perf_counter()
        backend.forward(tokens[:, CONTEXT:], last=last)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transformers_breakdown(backend) -> dict[int, dict[str, float]]:
    rows = {}
    for n in SIZES:
        total = _timed(backend, n, n)
        hooks = _Hooks(backend.model)
        hooked = _timed(backend, n, n)
        # REPEATS timed forwards (and as many prefills: removed below).
        parts = {k: v / REPEATS for k, v in hooks.seconds.items()}
        hooks.remove()
        prefill_hooks = _Hooks(backend.model)
        for _ in range(REPEATS):
            backend.reset()
            backend.forward(torch.arange(CONTEXT, dtype=torch.long)[None] % backend.vocab_size, last=1)
        prefill = {k: v / REPEATS for k, v in prefill_hooks.seconds.items()}
        prefill_hooks.remove()
        parts = {k: max(parts[k] - prefill.get(k, 0.0), 0.0) for k in parts}
        parts["other (framework, cache, Python)"] = total - sum(parts.values())
        rows[n] = {"total": total, "hooked_total": hooked, **parts}
    return rows


def llamacpp_breakdown(backend) -> dict[int, dict[str, float]]:
    rows = {}
    for n in SIZES:
        everywhere, last_only = _timed(backend, n, n), _timed(backend, n, 1)
        rows[n] = {
            "total": everywhere,
            "logits at the last position only": last_only,
            "head at the other positions": everywhere - last_only,
        }
    return rows


def native_breakdown(backend, sizes: tuple[int, ...] = SIZES) -> dict[int, dict[str, float]]:
    """Seconds in each native kernel per forward (the head apart from the other linear layers), timed around the same
    forwards as their total (the prefill before each is not timed); the rest is torch's small operations and Python."""
    seconds: dict[str, float] = defaultdict(float)
    homes = {"linear": formats, "attention": ops, "rms_norm": ops, "gated": ops}
    originals = {name: getattr(home, name) for name, home in homes.items()}

    def timed(name: str):
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            start = time.perf_counter()
            out = originals[name](*args, **kwargs)
            label = (
                "output head"
                if name == "linear" and args[1] is backend.model.head
                else {"linear": "other linear layers"}.get(name, name)
            )
            seconds[label] += time.perf_counter() - start
            return out

        return call

    tokens = torch.arange(CONTEXT + max(sizes), dtype=torch.long)[None] % backend.vocab_size
    rows = {}
    for n in sizes:
        total = _timed(backend, n, n)
        seconds.clear()
        hooked = 0.0
        for _ in range(REPEATS):
            backend.reset()
            backend.forward(tokens[:, :CONTEXT], last=1)
            for name in originals:
                setattr(homes[name], name, timed(name))
            try:
                start = time.perf_counter()
                backend.forward(tokens[:, CONTEXT : CONTEXT + n], last=n)
                hooked += time.perf_counter() - start
            finally:
                for name, function in originals.items():
                    setattr(homes[name], name, function)
        parts = {k: v / REPEATS for k, v in seconds.items()}
        parts["other (torch operations, Python)"] = hooked / REPEATS - sum(parts.values())
        rows[n] = {"total": total, "hooked_total": hooked / REPEATS, **parts}
    return rows


def weight_bytes(name: str, target) -> int:
    if name == "llama.cpp":
        return Path(gguf_path("gemma-3-270m")).stat().st_size
    if name == "native":  # what a step reads: every packed linear layer and norm (the embedding: only its rows)
        model = target.backend.model
        packed = [model.head] + [
            getattr(layer, part) for layer in model.layers for part in ("qkv", "out", "gate_up", "down")
        ]
        buffers = sum(b.numel() * b.element_size() for m in packed for b in m.buffers())
        return buffers + sum(w.numel() * 4 for layer in model.layers for w in layer.norms.values())
    model = target.backend.model
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def engine_overhead(runtime: RuntimeConfig, prompts: list[str]) -> dict[str, float]:
    """specdec's own seconds per step outside the target forward and drafting (prompt lookup, 64 new tokens)."""
    generator = Generator("gemma-3-270m", "prompt-lookup", runtime=runtime)
    generator.generate(prompts[0], max_new_tokens=8)
    steps = wall = inside = 0.0
    for prompt in prompts:
        stats = generator.generate(prompt, max_new_tokens=64, stop_on_eos=False).stats
        steps += stats.steps
        wall += stats.wall_s
        inside += stats.prefill_s + stats.draft_s + stats.verify_s
    return {"steps": steps, "per_step_ms": 1000 * (wall - inside) / steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--prompts", default="core")
    parser.add_argument("--out")
    args = parser.parse_args()
    machine = bandwidth()
    print(f"memory bandwidth: read {machine['read_GBps']:.1f} GB/s, copy {machine['copy_GBps']:.1f} GB/s", flush=True)
    prompts = [p.prompt for p in load_prompts(args.prompts)][:6]
    report = {"machine": machine, "threads": torch.get_num_threads(), "runtimes": {}}
    for name in args.runtimes.split(","):
        target = open_target("gemma-3-270m", RUNTIMES[name])
        size = weight_bytes(name, target)
        roofline_ms = 1000 * size / (machine["read_GBps"] * 1e9)
        breakdown = {"llama.cpp": llamacpp_breakdown, "native": native_breakdown}.get(name, transformers_breakdown)
        rows = breakdown(target.backend)
        del target
        overhead = engine_overhead(RUNTIMES[name], prompts)
        report["runtimes"][name] = {
            "weight_MB": size / 1e6,
            "roofline_ms": roofline_ms,
            "forward": rows,
            "engine": overhead,
        }
        print(
            f"\n{name}: {size / 1e6:.0f} MB of weights per step, roofline {roofline_ms:.1f} ms; "
            f"engine {overhead['per_step_ms']:.2f} ms/step"
        )
        for n, parts in rows.items():
            cells = "  ".join(f"{k} {1000 * v:.1f}" for k, v in parts.items())
            print(f"  n={n:2d}: {cells}  (ms; {rows[n]['total'] / rows[1]['total']:.2f}x n=1)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
