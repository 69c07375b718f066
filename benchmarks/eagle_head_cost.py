"""What one level of eagle drafting costs: the head as its transformers module and on native int8 kernels (issue 24).

Usage: python benchmarks/eagle_head_cost.py [--head DIR] [--count 12] [--new-tokens 64] [--out FILE]

1. Per level: the head reads a 64-token context, then a level of n = 1, 4 or 8 tree nodes is run and dropped again
   (median of 21), on each runner. The weight bytes each reads per level (module: its float32 parameters and output
   rows; native: the int8 weights and their scales) over this machine's measured read bandwidth give the roofline.
2. In the engine: gemma-3-270m on the transformers `cpu` plan (the issue's benchmark path), greedy, cost-model k <= 10,
   the first --count prompts of the default set taken in turn from each category; target-only, then the head as a
   chain and as a tree (4 branches) on each runner, interleaved prompt by prompt. Tokens/s, draft time per step
   (median), accepted tokens per step; every run's tokens are checked against target-only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from where_time_goes import bandwidth

from specdec import GenerationConfig, Generator
from specdec.bench.prompts import load_prompts, round_robin
from specdec.config import PrecisionPlan, RuntimeConfig
from specdec.drafters.eagle import NativeHead, load_eagle
from specdec.models import open_target
from specdec.models.registry import bundled_draft

LEVELS = (1, 4, 8)
CONTEXT = 64
REPEATS = 21


def level_times(drafter, hidden: torch.Tensor, tokens: torch.Tensor) -> dict[int, float]:
    """Median ms of one level of n nodes (root and children) after the context, dropped again as the drafter does."""
    runner = drafter.runner
    cache = runner.new_cache()
    with torch.inference_mode():
        runner.run(cache, tokens[1:], hidden[:-1], None)
        read = runner.length(cache)
        times = {}
        for n in LEVELS:
            parents = torch.tensor([-1] + [0] * (n - 1))
            samples = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                runner.run(cache, tokens[-n:], hidden[-n:], parents)
                runner.truncate(cache, read)
                samples.append(time.perf_counter() - start)
            times[n] = 1e3 * statistics.median(samples)
    return times


def weight_bytes(drafter) -> int:
    head = drafter.head
    if isinstance(head, NativeHead):
        packed = [head.fc, head.model.head] + [
            w for layer in head.model.layers for w in (layer.qkv, layer.out, layer.gate_up, layer.down)
        ]
        return sum(p.packed.numel() + 4 * p.scale.numel() for p in packed)
    return sum(p.numel() * p.element_size() for p in head.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=str(bundled_draft("gemma-3-270m", "eagle")))
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    read_gbs = bandwidth()["read_GBps"]
    target = open_target("gemma-3-270m", RuntimeConfig(precision=PrecisionPlan.parse("cpu")))
    embed = target.backend.token_embeddings()
    runners = {
        name: load_eagle(args.head, embed, target.backend.vocab_size, kernels=name == "native")
        for name in ("module", "native")
    }
    prompts = round_robin(load_prompts("default"))[: args.count]
    ids = target.tokenizer(prompts[0].prompt * 8, return_tensors="pt").input_ids[0][:CONTEXT]
    with torch.inference_mode():
        hidden = target.backend.model.model(input_ids=ids[None]).last_hidden_state[0].float()
    report: dict = {"bandwidth_read_gb_s": read_gbs, "levels": {}, "engine": {}}
    for name, drafter in runners.items():
        size = weight_bytes(drafter)
        report["levels"][name] = {
            "weight_mb": size / 1e6,
            "roofline_ms": size / read_gbs / 1e6,
            "ms": level_times(drafter, hidden, ids),
        }
        print(name, json.dumps(report["levels"][name]))

    generator = Generator(target, "none")
    settings = GenerationConfig(max_new_tokens=args.new_tokens, k=10, k_policy="cost-model", stop_on_eos=False)
    methods = {"none": (generator, 1)}
    for name, drafter in runners.items():
        drafted = Generator(target, drafter)
        methods |= {f"{name} chain": (drafted, 1), f"{name} tree": (drafted, 4)}
    runs: dict[str, list] = {method: [] for method in methods}
    for prompt in prompts:
        expected = None
        for method, (gen, branches) in methods.items():
            result = gen.generate(prompt.prompt, settings, branches=branches)
            expected = expected or result.token_ids
            runs[method].append((result.stats, result.token_ids == expected))
    for method, results in runs.items():
        stats = [s for s, _ in results]
        drafts = [d for s in stats for d in s.draft_s_per_step]
        row = {
            "tokens_per_s": sum(s.new_tokens for s in stats) / sum(s.wall_s for s in stats),
            "draft_ms_p50": 1e3 * statistics.median(drafts) if drafts else 0.0,
            "accepted_per_step": sum(s.draft_tokens_accepted for s in stats) / sum(s.steps for s in stats),
            "identical": sum(same for _, same in results) / len(results),
        }
        report["engine"][method] = row
        print(method, json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
