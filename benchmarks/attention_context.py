"""What verifying 9 positions costs against 1 as the context grows: native attention per layer, and whole steps.

Usage: python benchmarks/attention_context.py --out FILE [--before SO] [--model DIR]

1. The attention kernel of one layer in the shapes of Llama-3.1-8B (32 query heads over 8 KV heads of 128) and
   Gemma-3-270M (4 over 1 of 256), at 512, 2048 and 8192 cached positions: milliseconds for 1 and for 9 new positions
   (median of 31 calls) and the ratio, over a paged cache of each element type (float32, bfloat16, float16).
   ``--before SO``: the same for an earlier build of the kernels (a compiled module file over one contiguous float32
   cache per layer), side by side, with a check that its float32 results have the same bits as the paged float32 cache.
2. ``--model DIR`` (a safetensors folder the native runtime runs): a whole forward of 1 and of 9 new positions after
   512 and 2048 cached ones, int4, bfloat16 cache, so attention's share of a step shows next to the weights'.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.machine import fingerprint
from specdec.models.native import kernel_build, ops, paged_cache

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


def inputs(heads: int, kv_heads: int, dim: int, context: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=generator)
    keys, values = (torch.randn(context + n, kv_heads, dim, generator=generator) for _ in range(2))
    return q, keys, values


def paged_call(dtype: str, heads: int, kv_heads: int, dim: int, context: int, n: int, seed: int = 0):
    """One layer's attention of n new positions after ``context`` cached ones, over a paged cache of ``dtype``."""
    q, keys, values = inputs(heads, kv_heads, dim, context, n, seed)
    cache = paged_cache.PagedCache((0,), kv_heads, dim, dtype)
    cache.reserve(context + n)
    for index, page in enumerate(cache.pages[0]):  # the cached positions, written as the kernel writes them
        span = slice(index * paged_cache.PAGE, min(context, (index + 1) * paged_cache.PAGE))
        for part, tensor in enumerate((keys, values)):
            page[part, :, : span.stop - span.start] = tensor[span].transpose(0, 1).to(page.dtype)
    return lambda: ops.attention(q, keys[context:], values[context:], cache, 0, context, 0, 0.1)


def contiguous_call(module, heads: int, kv_heads: int, dim: int, context: int, n: int, seed: int = 0):
    """The same over one contiguous float32 cache [kv heads, positions, dim] (the kernels before paging)."""
    q, keys, values = inputs(heads, kv_heads, dim, context, n, seed)
    k_cache, v_cache = keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous()
    return lambda: module.attention(q, k_cache, v_cache, context, 0, 0.1, EMPTY_MASK, EMPTY_POSITIONS)


def kernel_rows(label: str, make_call) -> dict:
    rows = {}
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for context in CONTEXTS:
            cost = {n: median_ms(make_call(heads, kv_heads, dim, context, n)) for n in (1, 9)}
            rows[f"{shape} @ {context}"] = {"1": cost[1], "9": cost[9], "ratio": cost[9] / cost[1]}
            print(
                f"{label} {shape} context {context}: {cost[1]:.3f} / {cost[9]:.3f} ms ({cost[9] / cost[1]:.2f}x)",
                flush=True,
            )
    return rows


def same_bits(before) -> bool:
    after = paged_call("float32", 32, 8, 128, 600, 9, seed=1)()
    return torch.equal(contiguous_call(before, 32, 8, 128, 600, 9, seed=1)(), after)


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
    results: dict = {"machine": fingerprint() | {"threads": torch.get_num_threads(), "kernels": kernel_build.variant()}}
    columns = []
    if args.before:
        spec = importlib.util.spec_from_file_location(args.before.stem, args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        results["before"] = kernel_rows("before", functools.partial(contiguous_call, before))
        results["same_bits"] = same_bits(before)
        columns.append("before")
    for dtype in paged_cache.CACHE_DTYPES:
        results[dtype] = kernel_rows(f"paged {dtype}", functools.partial(paged_call, dtype))
        columns.append(dtype)
    if args.model:
        results["whole_steps"] = whole_steps(args.model)
    args.out.write_text(json.dumps(results, indent=1))
    print("| shape @ context | " + " | ".join(f"{k}: 1 / 9 positions (9 over 1)" for k in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for key in results[columns[-1]]:
        cells = [results[k][key] for k in columns]
        print(f"| {key} | " + " | ".join(f"{c['1']:.2f} / {c['9']:.2f} ms ({c['ratio']:.2f}x)" for c in cells) + " |")


if __name__ == "__main__":
    main()
