"""How often the eagle head's first draft is accepted when sampling: its top token against a draw from its own law
(issue 24).

Usage: python benchmarks/eagle_sampled_acceptance.py [--temperature 0.7] [--per-category 3] [--new-tokens 48]

A deterministic draft x is accepted with the target's p(x); a draft drawn from the head's tempered distribution q
with min(1, p/q), so sum min(p, q) = 1 - TV(p, q) in expectation. Along the target's own sampled text (gemma-3-270m on
the transformers `cpu` plan, the first prompts of each category, k = 1, seeded), each step records the head's q and
the target's p at the draft's position and reports both rates, per category, and what a tree level of the head's
b top tokens takes: the target's mass on them, since verification descends when the target's draw is one of them.

The head drafts its top tokens: at commit 0bef240 this script's --engine switch timed drawn chains in the engine
against them (`lookup-then-eagle`, every default prompt, taking turns): 0.99x, a wash, so they were not kept
(benchmarks/journal/notebook.md, "Drawn eagle chains").
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch

import specdec.drafters.eagle as eagle_module
import specdec.engine.step as step_module
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts
from specdec.config import PrecisionPlan, RuntimeConfig
from specdec.verification.shaping import to_probs

SIBLINGS = (2, 3, 4)  # tree levels of this many of the head's top tokens


def prompts(per_category: int) -> list[BenchPrompt]:
    """The default set's first ``per_category`` prompts of each category, in the set's order."""
    seen: Counter[str] = Counter()
    chosen = []
    for prompt in load_prompts(DEFAULT_PROMPTS):
        seen[prompt.category] += 1
        if seen[prompt.category] <= per_category:
            chosen.append(prompt)
    return chosen


def replay(gen: Generator, chosen: list[BenchPrompt], new_tokens: int, temperature: float) -> None:
    """First-draft acceptance of the head's top token and of a draw from its law, along the target's sampled text."""
    sampling = SamplingConfig(temperature=temperature)
    step: dict = {}  # this step's category, and the head's logits over its kept tokens for the step's first draft
    stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    grow, verify = eagle_module.EagleDrafter._grow, step_module.verify_rows

    def recording_grow(self, logits, feature, k, width, length):
        step["logits"], step["keep"] = logits.float().clone(), self.runner.keep_ids
        return grow(self, logits, feature, k, width, length)

    def recording_verify(steps, logits):
        if "logits" in step and len(steps[0].proposal):
            p = to_probs(logits[0, 0].float(), sampling)  # shaped as the engine shapes both
            q = torch.zeros_like(p)
            q[step["keep"]] = to_probs(step.pop("logits"), sampling)
            s = stats[step["category"]]
            s["top"] += float(p[int(q.argmax())])
            s["drawn"] += float(torch.minimum(p, q).sum())
            for b in SIBLINGS:  # a tree level of the head's b top tokens takes the target's draw when it is one of them
                s[f"top{b}"] += float(p[q.topk(b).indices].sum())
            s["steps"] += 1
        step.pop("logits", None)
        return verify(steps, logits)

    eagle_module.EagleDrafter._grow, step_module.verify_rows = recording_grow, recording_verify
    try:
        for seed, row in enumerate(chosen):
            step["category"] = row.category
            gen.generate(
                row.prompt,
                GenerationConfig(
                    max_new_tokens=new_tokens, k=1, k_policy="fixed", stop_on_eos=False, seed=seed, sampling=sampling
                ),
            )
    finally:
        eagle_module.EagleDrafter._grow, step_module.verify_rows = grow, verify
    print(
        f"temperature {temperature}: first draft accepted, the head's top token against a draw from its law, "
        "and a level of its b top tokens"
    )
    for category, s in stats.items():
        siblings = ", ".join(f"top {b} {s[f'top{b}'] / s['steps']:.3f}" for b in SIBLINGS)
        print(
            f"{category}: {int(s['steps'])} steps, top token {s['top'] / s['steps']:.3f}, "
            f"drawn {s['drawn'] / s['steps']:.3f}, {siblings}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    gen = Generator("gemma-3-270m", "eagle", runtime=RuntimeConfig(precision=PrecisionPlan.parse("cpu")))
    replay(gen, prompts(args.per_category), args.new_tokens, args.temperature)


if __name__ == "__main__":
    main()
