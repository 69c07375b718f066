"""What verification costs on each build of the native kernels, and where a step's time goes against this machine's
limits; native against llama.cpp's own `llama-bench` on the same machine.

Usage: python benchmarks/kernel_steps.py --out FILE [--builds avx2,avx2-vnni,avx512,amx] [--llama-bench PATH]
       [--llama-bench-avx2 PATH] [--llama-bench-avx2-vnni PATH] [--tokens 64] [--skip-1b]

Every x86 build this CPU runs is measured (each forced with SPECDEC_KERNELS in a process of its own; a forced build's
timings differ from a real CPU of that kind only in clock and caches):

1. The kernels alone, one thread (kernels/harness.cpp's timing mode, compiled with the build's flags): an int8 and an
   int4 layer at 1 and 9 rows, in Gemma-3-270M's output head shape (640 x 262,144, streamed from memory) and in a
   shape that stays in the caches (640 x 2,048: 1.3 MB in int8): its rate is the build's own compute ceiling
   (multiply-adds per second).
2. A native forward over 1 and 9 new positions after 64 cached ones (median of 7) for Gemma-3-270M in int8 and int4
   and a random-weight model in Llama-3.2-1B's shape in int4, split into the output head, the other linear layers,
   attention, norms, the MLP's activation and the rest (torch's small operations, Python); against the weight bytes
   over the measured read bandwidth (2 threads).
3. Prefill: a forward over 512 and 2,048 new tokens, tokens per second.
4. Through the engine (`Generator`, greedy, --tokens new tokens): target-only (`none`) and `auto` on Gemma-3-270M over
   the default prompt set and a set written for this check (benchmarks/prompts/kernels-unseen.jsonl); the engine's
   own milliseconds per step (prompt lookup, outside forwards and drafting).

--llama-bench: llama.cpp's benchmark built for this machine; --llama-bench-avx2: one built for AVX2 alone (compared
with the forced avx2 build); --llama-bench-avx2-vnni: one built for AVX2 with AVX-VNNI (compared with the avx2-vnni
build). Each runs tg (--tokens), pp9, pp512 and pp2048 on the Gemma-3-270M GGUF, 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = (1, 9)
PREFILL = (512, 2048)
HARNESS_SHAPES = {"head (memory)": (640, 262144), "L2": (640, 2048)}
PROMPT_SETS = ("default", "benchmarks/prompts/kernels-unseen.jsonl")


def harness_rates(build: str) -> dict:
    """Microseconds per call and multiply-adds per second of the bare kernels, one thread."""
    from specdec.models.native import kernel_build

    folder = kernel_build.KERNELS
    with tempfile.TemporaryDirectory() as where:
        binary = Path(where) / "harness"
        sources = [str(folder / f) for f in kernel_build.HARNESS_SOURCES]
        flags = [f for f in kernel_build.CFLAGS if f not in ("-fopenmp", "-DSPECDEC_TORCH")]
        command = ["g++", "-std=c++17", *flags, *kernel_build.VARIANTS[build][1], f"-I{folder}", *sources]
        subprocess.run([*command, "-o", str(binary)], check=True)
        rates: dict = {}
        for shape, (k, outputs) in HARNESS_SHAPES.items():
            for fmt in ("int8", "int4"):
                for rows in SIZES:
                    calls = max(3, int(4e9 / (k * outputs * rows)))
                    runs = [
                        float(
                            subprocess.run(
                                [str(binary), fmt, str(rows), str(k), str(outputs), str(calls)],
                                capture_output=True,
                                text=True,
                                check=True,
                            ).stdout
                        )
                        for _ in range(3)
                    ]
                    us = min(runs)
                    rates[f"{fmt} {shape} x{rows}"] = {"us": us, "gmacs": k * outputs * rows / us / 1e3}
    return rates


def weight_bytes(model) -> int:
    """What one step reads: every packed linear layer, the output head included (the embedding's few rows aside)."""
    packed = [model.head] + [
        getattr(layer, part) for layer in model.layers for part in ("qkv", "out", "gate_up", "down")
    ]
    return sum(b.numel() * b.element_size() for m in packed for b in m.buffers())


def prefill(backend) -> dict[int, float]:
    """Tokens per second of one forward over n new tokens (best of 2; logits at the last position)."""
    rates = {}
    for n in PREFILL:
        tokens = torch.arange(n, dtype=torch.long)[None] % backend.vocab_size
        best = float("inf")
        for _ in range(2):
            backend.reset()
            start = time.perf_counter()
            backend.forward(tokens, last=1)
            best = min(best, time.perf_counter() - start)
        rates[n] = n / best
    backend.reset()
    return rates


def engine(fmt: str, tokens: int) -> dict:
    """Tokens per second through the engine, target-only and auto, per prompt set (greedy, one run each)."""
    from specdec import Generator
    from specdec.bench.prompts import load_prompts
    from specdec.config import RuntimeConfig

    runtime = RuntimeConfig(backend="native", native_format=fmt)
    out: dict = {}
    for method in ("none", "auto"):
        generator = Generator("gemma-3-270m", method, runtime=runtime)
        generator.generate("Warm-up: the kernels and the cost curves.", max_new_tokens=8)
        for prompts in PROMPT_SETS:
            made = wall = 0.0
            for prompt in load_prompts(prompts):
                stats = generator.generate(prompt.prompt, max_new_tokens=tokens, stop_on_eos=False).stats
                made += stats.new_tokens
                wall += stats.wall_s
            out[f"{method} {Path(prompts).stem}"] = made / wall
    return out


def child(build: str, tokens: int, skip_1b: bool) -> dict:
    """Everything measured on one forced build (this process runs with SPECDEC_KERNELS=build)."""
    import where_time_goes
    from model_sizes import SHAPES, random_model

    from specdec.config import RuntimeConfig
    from specdec.models import open_target
    from specdec.models.native import NativeBackend, NativeModel, kernel_build

    if kernel_build.compiled() is None or kernel_build.build_name().split(" ")[0] != kernel_build.module_name(build):
        raise SystemExit(f"the {build} build did not load here ({kernel_build.build_name()})")
    result: dict = {"build": kernel_build.build_name(), "kernels": harness_rates(build), "models": {}}
    models = {
        f"gemma-3-270m {fmt}": lambda fmt=fmt: (
            open_target("gemma-3-270m", RuntimeConfig(backend="native", native_format=fmt)).backend
        )
        for fmt in ("int8", "int4")
    }
    if not skip_1b:
        models["llama-3.2-1b shape int4"] = lambda: NativeBackend(
            NativeModel.from_module(random_model(SHAPES["1b"]), "int4")
        )
    for name, make in models.items():
        backend = make()
        split = where_time_goes.native_breakdown(backend, SIZES)
        result["models"][name] = {
            "weight_bytes": weight_bytes(backend.model),
            "steps_ms": {n: {part: 1000 * s for part, s in parts.items()} for n, parts in split.items()},
            "prefill_tok_s": prefill(backend),
        }
        print(f"{build} {name}: {split[1]['total'] * 1000:.1f} / {split[9]['total'] * 1000:.1f} ms", file=sys.stderr)
        del backend
    from specdec.bench.prompts import load_prompts

    result["engine"] = {fmt: engine(fmt, tokens) for fmt in ("int8", "int4")}
    prompts = [p.prompt for p in load_prompts("default")][:4]
    result["engine_ms_per_step"] = where_time_goes.engine_overhead(RuntimeConfig(backend="native"), prompts)
    return result


def llama_bench(binary: str, tokens: int) -> dict[str, float]:
    """llama-bench's tokens per second: tg and pp9, pp512, pp2048 on the Gemma-3-270M GGUF (2 threads)."""
    from specdec.models.target import gguf_path

    model = gguf_path("gemma-3-270m")
    out = {}
    for label, p, n in [(f"tg{tokens}", 0, tokens), ("pp9", 9, 0), ("pp512", 512, 0), ("pp2048", 2048, 0)]:
        command = [binary, "-m", str(model), "-p", str(p), "-n", str(n), "-t", "2", "-r", "3", "-o", "json"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:  # a build of llama.cpp that crashes here (seen: its AMX path) is reported, not fatal
            print(f"{binary} {label} failed (exit {done.returncode}): left out", file=sys.stderr)
            continue
        (record,) = json.loads(done.stdout)
        out[label] = float(record["avg_ts"])
    return out


def main() -> None:
    from specdec.machine import fingerprint
    from specdec.models.native import kernel_build

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--builds", help="comma-separated; default: every x86 build this CPU runs")
    parser.add_argument("--llama-bench", help="llama-bench built for this machine")
    parser.add_argument("--llama-bench-avx2", help="llama-bench built for AVX2 alone")
    parser.add_argument("--llama-bench-avx2-vnni", help="llama-bench built for AVX2 with AVX-VNNI")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.skip_1b)))
        return
    if args.out is None:
        parser.error("--out FILE is required")
    runs = [name for name, (needs, _) in kernel_build.VARIANTS.items() if set(needs) <= kernel_build.cpu_flags()]
    builds = args.builds.split(",") if args.builds else [b for b in runs if b != "neon"]
    if missing := [b for b in builds if b not in runs]:
        parser.error(f"this CPU does not run the build(s) {', '.join(missing)}: it runs {', '.join(runs)}")
    from where_time_goes import bandwidth

    result: dict = {"machine": fingerprint(), "bandwidth": bandwidth(), "tokens": args.tokens, "builds": {}}
    for build in builds:
        command = [sys.executable, __file__, "--child", build, "--tokens", str(args.tokens)]
        command += ["--skip-1b"] if args.skip_1b else []
        done = subprocess.run(command, env={**os.environ, kernel_build.FORCE: build}, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {build} build's measurement failed (exit {done.returncode})")
        result["builds"][build] = json.loads(done.stdout.splitlines()[-1])
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # each build's figures kept as soon as they exist
    peers = (
        ("llama_bench", args.llama_bench),
        ("llama_bench_avx2", args.llama_bench_avx2),
        ("llama_bench_avx2_vnni", args.llama_bench_avx2_vnni),
    )
    for key, binary in peers:
        if binary:
            result[key] = llama_bench(binary, args.tokens)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))


def summary(result: dict) -> str:
    """The headline ratios as text."""
    lines = []
    read = result["bandwidth"]["read_GBps"]
    for build, b in result["builds"].items():
        for name, m in b["models"].items():
            one, nine = m["steps_ms"]["1"]["total"], m["steps_ms"]["9"]["total"]
            roof = m["weight_bytes"] / read / 1e6
            pre = ", ".join(f"pp{n} {r:.0f}" for n, r in m["prefill_tok_s"].items())
            lines.append(
                f"{build} {name}: 1 / 9 positions {one:.1f} / {nine:.1f} ms ({nine / one:.2f}x), "
                f"roofline {roof:.1f} ms; prefill tok/s {pre}"
            )
        lines.append(f"{build} engine tok/s: {json.dumps(b['engine'])}")
    for key in ("llama_bench", "llama_bench_avx2", "llama_bench_avx2_vnni"):
        if key in result:
            lines.append(f"{key}: {json.dumps(result[key])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
