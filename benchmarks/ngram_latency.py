"""Latency of the n-gram drafter alone: propose(k = 8) on the last 40 contexts of every prompt (greedy).

Run after building /tmp/gemma-corpus.ngram as in benchmarks/journal/notebook.md: python benchmarks/ngram_latency.py
"""

import time

import torch

from specdec.bench.prompts import load_prompts
from specdec.drafters import DraftSettings, NgramDrafter, NgramTable
from specdec.models import load_model

tok = load_model("gemma-3-270m").tokenizer
d = NgramDrafter(NgramTable.load("/tmp/gemma-corpus.ngram"))
d.begin(DraftSettings())  # greedy
lat = []
for prompt in load_prompts("default"):
    ids = tok(prompt.prompt)["input_ids"]
    for cut in range(max(2, len(ids) - 40), len(ids) + 1):
        ctx = torch.tensor(ids[:cut])
        t = time.perf_counter()
        d.propose(ctx, 8)
        lat.append((time.perf_counter() - t) * 1000)
lat.sort()
print(
    len(lat), "p50", round(lat[len(lat) // 2], 3), "p99", round(lat[int(0.99 * len(lat))], 3), "max", round(lat[-1], 3)
)
