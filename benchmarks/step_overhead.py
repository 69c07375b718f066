"""Per-step engine overhead on a tiny model (where the model costs ~1.7 ms, so the engine's own Python shows): ms per step, target-only and prompt lookup.

Run it under two checkouts (e.g. PYTHONPATH=OLD/src) to compare engine versions."""

import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "tests"))
torch.set_num_threads(2)
from conftest import loaded, tiny_gemma3

from specdec import Generator
from specdec.drafters import NoDrafter, PromptLookupDrafter

m = tiny_gemma3(0)
for name, d in [("none", NoDrafter()), ("lookup", PromptLookupDrafter())]:
    g = Generator(loaded(m), d)
    g.generate([1, 5, 9, 5, 9], max_new_tokens=64, k=4, k_policy="fixed", stop_on_eos=False)
    best = []
    for rep in range(5):
        t = time.perf_counter()
        for _ in range(10):
            r = g.generate([1, 5, 9, 5, 9], max_new_tokens=64, k=4, k_policy="fixed", stop_on_eos=False)
        best.append((time.perf_counter() - t) / (10 * r.stats.steps) * 1e3)
    print(name, "ms/step min %.3f median %.3f" % (min(best), sorted(best)[2]), r.stats.steps)
