"""The suffix drafter's costs at scale: proposal time, memory per cached token and peak RSS, by store size.

Usage: python benchmarks/suffix_store.py --out FILE [--sizes 100000,1000000] [--steps 400]

The store is filled with real token streams: the Python standard library's source files, tokenized by Gemma-3's
tokenizer and cut into 256-token "answers" (code repeats structure the way agent outputs do, so lookups find many
matches, the expensive case). Proposals are then timed along held-out files (a context that grows one token per
step, as in decoding), k = 8 with 4 branches. Each size runs in a fresh child process so that its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ANSWER = 256  # tokens per stored sequence


def corpus(tokens_wanted: int, held_out: bool) -> list[int]:
    """Tokens of the standard library's .py files (sorted paths; the held-out part from the end of the list)."""
    from specdec.models import open_target

    tokenizer = open_target("gemma-3-270m").tokenizer
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = files[::-1] if held_out else files
    tokens: list[int] = []
    for path in files:
        try:
            tokens += tokenizer(path.read_text(encoding="utf-8"))["input_ids"][1:]
        except (UnicodeDecodeError, OSError):
            continue
        if len(tokens) >= tokens_wanted:
            break
    return tokens[:tokens_wanted]


def _peak_rss() -> int:
    """This process's resident-memory high-water mark (VmHWM; ru_maxrss would keep the parent's across exec)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(size: int, steps: int, tokens: Path) -> dict:
    import numpy as np
    import torch

    from specdec.drafters.base import DraftSettings
    from specdec.drafters.suffix import SuffixDrafter, SuffixStore

    with np.load(tokens) as data:
        stored, queries = data["stored"][:size].tolist(), data["queries"].tolist()
    rss_before = _peak_rss()
    store = SuffixStore(max_tokens=size)
    start = time.perf_counter()
    for i in range(0, len(stored), ANSWER):
        store.add(stored[i : i + ANSWER])
    fill_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, 100 * ANSWER, ANSWER):  # the store is full: each answer added evicts the oldest
        store.add(queries[i % 4096 : i % 4096 + ANSWER])
    full_add_s = (time.perf_counter() - start) / 100
    drafter = SuffixDrafter(store)
    drafter.begin(DraftSettings())
    context = torch.tensor(queries[:512])
    drafter.propose(context, 8, 4)  # the request's own prompt index: once per request, not per step
    times, nodes = [], []
    for step in range(steps):
        context = torch.tensor(queries[: 513 + step])
        start = time.perf_counter()
        proposal = drafter.propose(context, 8, 4)
        times.append(time.perf_counter() - start)
        nodes.append(len(proposal))
    times.sort()
    return {
        "cached_tokens": store.token_count,
        "store_bytes": store.nbytes,
        "bytes_per_token": store.nbytes / store.token_count,
        "fill_s": fill_s,
        "add_ms_per_answer": 1000 * fill_s / (len(stored) / ANSWER),
        "propose_ms_p50": 1000 * statistics.median(times),
        "propose_ms_p99": 1000 * times[int(0.99 * (len(times) - 1))],
        "propose_ms_mean": 1000 * statistics.fmean(times),
        "mean_nodes": statistics.fmean(nodes),
        "add_ms_per_answer_when_full": 1000 * full_add_s,
        "peak_rss_bytes": _peak_rss(),
        "peak_rss_before_store_bytes": rss_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps, args.tokens)))
        return
    import numpy as np

    from specdec.machine import cpu_name

    sizes = [int(s) for s in args.sizes.split(",")]
    tokens = args.out.with_name(args.out.name + ".tokens.npz")
    np.savez(tokens, stored=np.array(corpus(max(sizes), held_out=False)), queries=np.array(corpus(8_000, True)))
    results = []
    for size in sizes:
        command = [sys.executable, __file__, "--out", str(args.out), "--steps", str(args.steps), "--child", str(size)]
        command += ["--tokens", str(tokens)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"{r['cached_tokens']:>9} tokens: propose p50 {r['propose_ms_p50']:.3f} ms, "
            f"p99 {r['propose_ms_p99']:.3f} ms; {r['bytes_per_token']:.0f} B/token; "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    tokens.unlink()
    machine = {"cpu": cpu_name(), "cores": os.cpu_count()}
    args.out.write_text(json.dumps({"machine": machine, "store_sizes": results}, indent=2))


if __name__ == "__main__":
    main()
