"""How fast is the output head on this CPU when its weights are read once per step for every position? (issue 23)

Usage: python benchmarks/head_kernel_probe.py [--out FILE]

The int8 AVX-512 VNNI kernel of the `int8a8` format and the native backend (specdec.models.native.kernel_build; needs
g++, ninja and a CPU with avx512_vnni) computes Gemma-3-270M's head (262,144 x 640) in int8 with a scale per vocabulary
row and per 128 inputs of a position, each block of weights loaded once and used for all n positions. Integer dot
products are exact, so a row's logits do not depend on n (batch-invariant: a 9-token verification computes what nine
one-token steps would). Compared with torch's bfloat16 and float32 products on the same shapes and with the measured
roofline, and checked against a float32 reference of the same int8 values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from specdec.models.native import formats, kernel_build


def best_ms(f, repeats: int = 9) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    from specdec.models import load_model

    weight = load_model("gemma-3-270m").model.get_output_embeddings().weight.detach().float().contiguous()
    vocab, width = weight.shape
    packed = formats.PackedInt8(weight)
    w8, w_scale = formats.quantize_rows(weight)
    if kernel_build.compiled() is None:
        raise SystemExit("this machine cannot build or run the VNNI kernel (see specdec.models.native.kernel_build)")
    bf16, rows = weight.bfloat16(), {}
    for n in (1, 2, 5, 9, 17):
        hidden = torch.randn(n, width) * 3
        product = partial(formats.linear, hidden, packed)
        logits = product()
        q, q_scale = formats.quantize_rows(hidden, packed.group)
        groups = q.float().reshape(n, -1, packed.group), w8.float().reshape(vocab, -1, packed.group)
        reference = (torch.einsum("ngc,vgc->nvg", *groups) * q_scale[:, None, :]).sum(dim=2) * w_scale[None, :]
        alone = torch.cat([formats.linear(hidden[i : i + 1], packed) for i in range(n)])
        rows[n] = {
            "int8 VNNI, weights read once": best_ms(product),
            "torch bfloat16": best_ms(partial(torch.nn.functional.linear, hidden.bfloat16(), bf16)),
            "torch float32": best_ms(partial(torch.nn.functional.linear, hidden, weight), repeats=3),
            "max |error| vs float32 of the same int8 values": float((logits - reference).abs().max()),
            "rows equal computed alone": bool(torch.equal(logits, alone)),
        }
        cells = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[n].items())
        print(f"n={n:2d}: {cells}", flush=True)
    print(
        f"int8 head: {w8.numel() / 1e6:.0f} MB, bfloat16 {2 * w8.numel() / 1e6:.0f} MB, "
        f"float32 {4 * w8.numel() / 1e6:.0f} MB"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
