"""Per-step engine overhead on a tiny model, where the model costs ~1.7 ms and the engine's own Python shows.

    python benchmarks/step_overhead.py                     # this checkout
    PYTHONPATH=OTHER/src python benchmarks/step_overhead.py  # another checkout, to compare engine versions

Prints ms per step (min and median of 5 rounds of 10 generations of 64 tokens), target-only and prompt lookup.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from specdec import Generator
from specdec.drafters import NoDrafter, PromptLookupDrafter


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import loaded, tiny_gemma3  # the test suite's tiny models

    torch.set_num_threads(2)
    model = tiny_gemma3(0)
    settings = dict(max_new_tokens=64, k=4, k_policy="fixed", stop_on_eos=False)
    for name, drafter in (("target-only", NoDrafter()), ("prompt lookup", PromptLookupDrafter())):
        gen = Generator(loaded(model), drafter)
        gen.generate([1, 5, 9, 5, 9], **settings)  # warm-up
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            steps = sum(gen.generate([1, 5, 9, 5, 9], **settings).stats.steps for _ in range(10))
            rounds.append((time.perf_counter() - start) / steps * 1e3)
        print(f"{name}: ms per step min {min(rounds):.3f}, median {sorted(rounds)[2]:.3f}")


if __name__ == "__main__":
    main()
