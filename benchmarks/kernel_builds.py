"""Linear-layer kernels for a 4-bit format, measured against the same bar: each weight read once per call, and a row's
bits independent of the rows beside it.

Usage: python benchmarks/kernel_builds.py --out FILE [--copies 8]

The matrix is an 8B Llama's MLP input ([2 x 14,336, 4,096]); ``--copies`` copies of it are multiplied in turn so the
working set outgrows the CPU's caches, as a whole model's does. Milliseconds per matrix at 1 and at 9 rows (best of 3
passes), and whether 1, 5 and 13 rows give each row the same bits. Measured: torch's maintained int4 kernel
(``_weight_int4pack_mm_for_cpu``, groups of 32, bfloat16 activations), and the native int8 and int4 formats on every
build of specdec's kernels this CPU runs (AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.machine import fingerprint
from specdec.models.native import formats, kernel_build

OUTPUTS, WIDTH, GROUP = 2 * 14336, 4096, 32


def pass_ms(products: list, rows: int) -> float:
    x = torch.randn(rows, WIDTH)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for product in products:
            product(x)
        best = min(best, time.perf_counter() - start)
    return 1000 * best / len(products)


def independent(product) -> bool:
    x = torch.randn(13, WIDTH, generator=torch.Generator().manual_seed(0))
    whole = product(x)
    return all(torch.equal(product(x[:n].contiguous()), whole[:n]) for n in (1, 5)) and torch.equal(
        torch.cat([product(x[i : i + 1].contiguous()) for i in range(13)]), whole
    )


def torch_int4(weight: torch.Tensor):
    """torch's int4 kernel on ``weight`` (asymmetric groups of 32, its own packing), as a function of float32 rows."""
    groups = weight.reshape(OUTPUTS, -1, GROUP)
    least, top = groups.amin(2), groups.amax(2)
    scale = ((top - least) / 15).clamp(min=1e-6)
    q = torch.round((groups - least[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(OUTPUTS, WIDTH)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale, least + 8 * scale], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, scales_zeros)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--copies", type=int, default=8)
    args = parser.parse_args()
    weight = torch.randn(OUTPUTS, WIDTH, generator=torch.Generator().manual_seed(1))
    results: dict = {
        "machine": fingerprint() | {"threads": torch.get_num_threads()},
        "copies": args.copies,
        "kernels": {},
    }
    candidates = {
        "torch _weight_int4pack_mm_for_cpu (bf16 activations)": [torch_int4(weight) for _ in range(args.copies)]
    }
    builds = [name for name, (needs, _) in kernel_build.VARIANTS.items() if set(needs) <= kernel_build.cpu_flags()]
    for format in ("int8", "int4"):
        packed = formats.FORMATS[format](weight)
        state = packed.state()
        copies = [packed] + [
            formats.Packed.restore({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
            for _ in range(args.copies - 1)
        ]
        for name in builds:
            module = kernel_build.build(name=name)
            candidates[f"native {format}, {name} build"] = [lambda x, p=p, m=module: p.product(m, x) for p in copies]
    for label, products in candidates.items():
        row = {"1": pass_ms(products, 1), "9": pass_ms(products, 9), "rows independent": independent(products[0])}
        results["kernels"][label] = row
        print(
            f"| {label} | {row['1']:.2f} | {row['9']:.2f} | {row['9'] / row['1']:.2f}x | {row['rows independent']} |",
            flush=True,
        )
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
