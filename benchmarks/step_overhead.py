"""Per-step engine overhead on a tiny model, where the model costs ~1.7 ms and the engine's own Python shows.

    python benchmarks/step_overhead.py                     # this checkout
    PYTHONPATH=OTHER/src python benchmarks/step_overhead.py  # another checkout, to compare engine versions

Prints ms per step (min and median of 5 rounds), target-only and prompt lookup: single sequences (10 generations
of 64 tokens per round) and batches of 8 (2 batches of 8 generations of 64 tokens per round, fixed k_cap).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdec import Generator
from specdec.config import BatchConfig
from specdec.drafters import NoDrafter, PromptLookupDrafter


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import loaded, tiny_gemma3  # the test suite's tiny models

    torch.set_num_threads(2)
    model = tiny_gemma3(0)
    settings = dict(max_new_tokens=64, k=4, k_policy="fixed", stop_on_eos=False)
    prompts = [
        [1, 5, 9, 5, 9],
        [1, 40, 41, 42, 43, 40, 41],
        [1, 7],
        [1, 3, 3, 3, 3],
        [1, 60, 61],
        [1, 9, 8],
        [1, 5],
        [1, 20, 21, 20],
    ]
    for name, drafter in (("target-only", NoDrafter()), ("prompt lookup", PromptLookupDrafter())):
        gen = Generator(loaded(model), drafter, batch=BatchConfig(k_cap="fixed"))

        def alone(gen: Generator = gen) -> int:
            return sum(gen.generate(prompts[0], **settings).stats.steps for _ in range(10))

        def batched(gen: Generator = gen) -> int:
            steps = 0
            for _ in range(2):
                decoder = gen.batch_decoder()
                gen.generate_batch(prompts, decoder=decoder, **settings)
                steps += len(decoder.reports)
            return steps

        alone(), batched()  # warm-up
        _report(f"{name}, one sequence", alone)
        _report(f"{name}, batch of 8", batched)


def _report(name: str, run: Callable[[], int]) -> None:
    """Time 5 rounds of ``run``, which returns how many steps it took."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        steps = run()
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    print(f"{name}: ms per step min {min(rounds):.3f}, median {sorted(rounds)[2]:.3f}")


if __name__ == "__main__":
    main()
