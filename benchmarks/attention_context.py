"""What verifying 9 positions costs against 1 as the context grows: native attention per layer, and whole steps.

Usage: python benchmarks/attention_context.py --out FILE [--before SO] [--model DIR]

1. The attention kernel of one layer in the shapes of Llama-3.1-8B (32 query heads over 8 KV heads of 128) and
   Gemma-3-270M (4 over 1 of 256), at 512, 2048 and 8192 cached positions: milliseconds for 1 and for 9 new positions
   (median of 31 calls), and the ratio. ``--before SO``: the same for an earlier build of the kernels (a compiled
   module file), side by side, with a check that both give the same bits.
2. ``--model DIR`` (a safetensors folder the native runtime runs): a whole forward of 1 and of 9 new positions after
   512 and 2048 cached ones, int4, so attention's share of a step shows next to the weights'.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.machine import fingerprint
from specdec.models import cpu_kernels

SHAPES = {"8b": (32, 8, 128), "270m": (4, 1, 256)}
CONTEXTS = (512, 2048, 8192)
EMPTY_MASK, EMPTY_POSITIONS = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.long)


def median_ms(call, repeats: int = 31) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def kernel_rows(module, label: str) -> dict:
    rows = {}
    generator = torch.Generator().manual_seed(0)
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for context in CONTEXTS:
            keys = torch.randn(kv_heads, context + 16, dim, generator=generator)
            values = torch.randn(kv_heads, context + 16, dim, generator=generator)
            cost = {}
            for n in (1, 9):
                q = torch.randn(n, heads, dim, generator=generator)
                call = (q, keys, values, context, 0, 0.1, EMPTY_MASK, EMPTY_POSITIONS)
                cost[n] = median_ms(lambda call=call: module.attention(*call))
            rows[f"{shape} @ {context}"] = {"1": cost[1], "9": cost[9], "ratio": cost[9] / cost[1]}
            print(
                f"{label} {shape} context {context}: {cost[1]:.3f} / {cost[9]:.3f} ms ({cost[9] / cost[1]:.2f}x)",
                flush=True,
            )
    return rows


def same_bits(before, after) -> bool:
    generator = torch.Generator().manual_seed(1)
    keys, values = torch.randn(8, 700, 128, generator=generator), torch.randn(8, 700, 128, generator=generator)
    q = torch.randn(9, 32, 128, generator=generator)
    call = (q, keys, values, 600, 0, 0.1, EMPTY_MASK, EMPTY_POSITIONS)
    return torch.equal(before.attention(*call), after.attention(*call))


def whole_steps(folder: str) -> dict:
    from specdec.config import RuntimeConfig
    from specdec.models import open_target

    backend = open_target(folder, RuntimeConfig(backend="native", native_format="int4")).backend
    rows = {}
    for context in (512, 2048):
        prefix = torch.randint(3, 1000, (1, context), generator=torch.Generator().manual_seed(2))
        backend.reset()
        backend.forward(prefix, last=1)
        cost = {}
        for n in (1, 9):
            new = torch.randint(3, 1000, (1, n))

            def step(new=new, n=n, context=context) -> None:
                backend.forward(new, last=n)
                backend.truncate(context)

            cost[n] = median_ms(step, repeats=5)
        rows[str(context)] = {"1": cost[1], "9": cost[9], "ratio": cost[9] / cost[1]}
        print(f"whole step after {context}: {cost[1]:.1f} / {cost[9]:.1f} ms ({cost[9] / cost[1]:.2f}x)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before", type=Path, help="an earlier build of the kernels (.so) to compare with")
    parser.add_argument("--model", help="a safetensors folder for whole steps")
    args = parser.parse_args()
    after = cpu_kernels.compiled()
    results: dict = {"machine": fingerprint() | {"threads": torch.get_num_threads(), "kernels": cpu_kernels.variant()}}
    results["after"] = kernel_rows(after, "after")
    if args.before:
        spec = importlib.util.spec_from_file_location(args.before.stem, args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        results["before"] = kernel_rows(before, "before")
        results["same_bits"] = same_bits(before, after)
    if args.model:
        results["whole_steps"] = whole_steps(args.model)
    args.out.write_text(json.dumps(results, indent=1))
    print(
        "| shape @ context | "
        + " | ".join(f"{k}: 1 / 9 positions (9 over 1)" for k in ("before", "after") if k in results)
        + " |"
    )
    print("|---|" + "---|" * (2 if args.before else 1))
    for key in results["after"]:
        cells = [results[k][key] for k in ("before", "after") if k in results]
        print(f"| {key} | " + " | ".join(f"{c['1']:.2f} / {c['9']:.2f} ms ({c['ratio']:.2f}x)" for c in cells) + " |")


if __name__ == "__main__":
    main()
