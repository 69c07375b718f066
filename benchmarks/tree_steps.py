"""Where a tree row's time goes: its steps by kind, against a chain row's, drafting and verification timed (issue 24).

Usage: python benchmarks/tree_steps.py [--temperature 0.7] [--drafter lookup-then-eagle] [--per-category 2]

gemma-3-270m on the transformers `cpu` plan, the first --per-category prompts of each category of the default set,
64 new tokens, cost-model k <= 10, seeded as `specdec bench` is; the drafter as a chain row, then as a tree row (the
benchmarks' branches). Each step the cost model observes is sorted into: tree steps whose draft branched, tree steps
cut to a chain (a whole tree drafted, a chain verified), and chain steps; per kind, how many, the nodes verified, the
tokens accepted, the model forwards drafted (Proposal.draft_steps), and the milliseconds of drafting and of
verification (the step's forward and verdict).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from eagle_sampled_acceptance import prompts

import specdec.scheduling.k_policy as k_policy
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import TREE_BRANCHES, PrecisionPlan, RuntimeConfig


def run(gen: Generator, chosen: list, sampling: SamplingConfig, branches: int) -> None:
    """Generate every prompt as `specdec bench` does and print the row's steps by kind."""
    kinds: dict[str, list] = defaultdict(list)
    observe = k_policy.CostModelK.observe

    def recording(self: k_policy.CostModelK, outcome: k_policy.StepOutcome) -> None:
        if outcome.verify_s is not None:  # not the step that read the prompt
            kind = "tree, branched" if outcome.branched else "tree, cut to a chain" if self._drafting_tree else "chain"
            kinds[kind].append(outcome)
        observe(self, outcome)

    k_policy.CostModelK.observe = recording  # type: ignore[method-assign]
    tokens, start = 0, time.perf_counter()
    try:
        for seed, prompt in enumerate(chosen):
            config = GenerationConfig(
                max_new_tokens=64,
                k=10,
                k_policy="cost-model",
                branches=branches,
                stop_on_eos=False,
                seed=seed,
                sampling=sampling,
            )
            tokens += len(gen.generate(prompt.prompt, config).token_ids)
    finally:
        k_policy.CostModelK.observe = observe  # type: ignore[method-assign]
    steps = sum(len(v) for v in kinds.values())
    print(
        f"{'tree' if branches > 1 else 'chain'} row: {tokens / (time.perf_counter() - start):.2f} tok/s, {steps} steps"
    )
    for kind, outcomes in kinds.items():
        n = len(outcomes)
        verified = sum(o.nodes for o in outcomes) / n
        accepted = sum(o.accepted for o in outcomes) / n
        forwards = sum(o.draft_steps for o in outcomes) / n
        draft_ms = 1e3 * sum(o.draft_s for o in outcomes) / n
        verify_ms = 1e3 * sum(o.verify_s for o in outcomes) / n
        print(
            f"  {kind}: {n} steps, {verified:.2f} nodes verified, {accepted:.2f} accepted, "
            f"{forwards:.2f} draft forwards, drafting {draft_ms:.1f} ms, verification {verify_ms:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--drafter", default="lookup-then-eagle")
    parser.add_argument("--per-category", type=int, default=2)
    args = parser.parse_args()
    gen = Generator("gemma-3-270m", args.drafter, runtime=RuntimeConfig(precision=PrecisionPlan.parse("cpu")))
    sampling = SamplingConfig(temperature=args.temperature)
    chosen = prompts(args.per_category)
    for branches in (1, TREE_BRANCHES):
        run(gen, chosen, sampling, branches)


if __name__ == "__main__":
    main()
