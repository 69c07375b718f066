"""What a greedy step saves when the output head finds each position's argmax without writing the logits.

Usage: python benchmarks/greedy_head.py --out FILE [--builds avx2,avx2-vnni,avx512,amx] [--repeats 41]

For each x86 build this CPU runs (each forced with SPECDEC_KERNELS in a process of its own) and Gemma-3-270M in int8
and int4: a native step over 1 and 9 new positions after 64 cached ones, taken two ways in turn (so that a drift of
the machine's speed touches both alike), median milliseconds of each:

- ``logits``: the forward writes the logits [n, 262,144] and the argmax is taken from them (``torch.max``), as a greedy
  step did before;
- ``argmax``: ``forward_argmax``, the output head keeping each position's running maximum instead.

Both give the same tokens (checked on every repeat).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

SIZES = (1, 9)
CACHED = 64


def child(build: str, repeats: int) -> dict:
    from specdec.config import RuntimeConfig
    from specdec.models import open_target
    from specdec.models.native import kernel_build

    if kernel_build.compiled() is None or kernel_build.build_name().split(" ")[0] != kernel_build.module_name(build):
        raise SystemExit(f"the {build} build did not load here ({kernel_build.build_name()})")
    out: dict = {"build": kernel_build.build_name()}
    for fmt in ("int8", "int4"):
        backend = open_target("gemma-3-270m", RuntimeConfig(backend="native", native_format=fmt)).backend
        context = torch.randint(0, 1000, (1, CACHED + max(SIZES)), generator=torch.Generator().manual_seed(0))
        backend.forward(context[:, :CACHED])
        for n in SIZES:
            fed = context[:, CACHED : CACHED + n]
            ways = {
                "logits": lambda fed=fed, backend=backend: backend.forward(fed).max(dim=-1).indices,
                "argmax": lambda fed=fed, backend=backend: backend.forward_argmax(fed),
            }
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(repeats):
                chosen = {}
                for way, run in ways.items():
                    start = time.perf_counter()
                    chosen[way] = run()
                    times[way].append(time.perf_counter() - start)
                    backend.truncate(CACHED)
                if not torch.equal(chosen["logits"], chosen["argmax"]):
                    raise SystemExit(f"{build} {fmt} n={n}: the two ways chose different tokens")
            medians = {way: 1000 * sorted(t)[len(t) // 2] for way, t in times.items()}
            out[f"gemma-3-270m {fmt} x{n}"] = medians | {"ratio": medians["argmax"] / medians["logits"]}
            print(f"{build} {fmt} x{n}: {medians}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--builds", default="")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.child:
        Path(args.out).write_text(json.dumps(child(args.child, args.repeats)))
        return
    from specdec.machine import fingerprint
    from specdec.models.native import kernel_build

    flags = kernel_build.cpu_flags()
    runnable = [name for name, (needs, _) in kernel_build.VARIANTS.items() if name != "neon" and set(needs) <= flags]
    builds = args.builds.split(",") if args.builds else runnable
    result: dict = {"machine": fingerprint(), "greedy_head": {}}
    for build in builds:
        part = Path(args.out).with_suffix(f".{build}.json")
        environment = os.environ | {"SPECDEC_KERNELS": build}
        command = [sys.executable, __file__, "--out", str(part), "--child", build, "--repeats", str(args.repeats)]
        subprocess.run(command, env=environment, check=True)
        result["greedy_head"][build] = json.loads(part.read_text())
        part.unlink()
    Path(args.out).write_text(json.dumps(result, indent=1))
    for build, parts in result["greedy_head"].items():
        for name, m in parts.items():
            if name != "build":
                print(f"{build} {name}: {m['logits']:.2f} -> {m['argmax']:.2f} ms ({m['ratio']:.3f})")


if __name__ == "__main__":
    main()
