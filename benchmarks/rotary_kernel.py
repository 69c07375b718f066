"""What the rotary-embedding kernel (``ops.rotate``, one call per layer for the queries and one for the keys) saves
against torch's formula (``x * cos + rotate_half(x) * sin``: five small torch operations), on the native runtime.

Usage: python benchmarks/rotary_kernel.py [--repeats 61]

Gemma-3-270M in int8 and int4, a greedy step (``forward_argmax``) over 1 and 9 new positions after 64 cached ones,
the two ways in turn within one process (the model's ``ops`` switched between repeats), so that a drift of the
machine's speed touches both alike: median milliseconds of each and the median of the paired differences. Both give
the same bits (tests/test_native.py), so the tokens are the same.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.config import RuntimeConfig
from specdec.models import open_target
from specdec.models.native import model as native_model
from specdec.models.native import ops


class Ops:
    """The native model's view of ``ops`` with ``rotate`` switched."""

    def __init__(self, rotate) -> None:
        self.rotate = rotate

    def __getattr__(self, name: str):
        return getattr(ops, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=61)
    args = parser.parse_args()
    torch.set_num_threads(2)
    ways = {"kernel": Ops(ops.rotate), "torch": Ops(ops.rotate_reference)}
    try:
        for fmt in ("int8", "int4"):
            backend = open_target("gemma-3-270m", RuntimeConfig(backend="native", native_format=fmt)).backend
            context = torch.randint(0, 1000, (1, 73), generator=torch.Generator().manual_seed(0))
            backend.forward(context[:, :64])
            for n in (1, 9):
                times: dict[str, list[float]] = {way: [] for way in ways}
                for _ in range(args.repeats):
                    for way, view in ways.items():
                        native_model.ops = view
                        start = time.perf_counter()
                        backend.forward_argmax(context[:, 64 : 64 + n])
                        times[way].append(time.perf_counter() - start)
                        backend.truncate(64)
                saved = statistics.median(t - k for t, k in zip(times["torch"], times["kernel"], strict=True))
                kernel, formula = (1000 * statistics.median(times[way]) for way in ("kernel", "torch"))
                print(f"{fmt} x{n}: kernel {kernel:.2f} ms, torch's formula {formula:.2f} ms, saved {1000 * saved:.2f}")
    finally:
        native_model.ops = ops


if __name__ == "__main__":
    main()
