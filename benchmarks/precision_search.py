"""Search precision plans for the target: target-only greedy speed and perplexity change per plan.

Usage: python benchmarks/precision_search.py [--out FILE] [PLAN ...]
Each plan (a preset or component=format parts) decodes the core prompts
target-only (greedy, 32 new tokens, after one warm-up) and scores the perplexity
files against float32. Prints a table; writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

from specdec import Generator
from specdec.bench.perplexity import read_tokens, score
from specdec.bench.prompts import load_prompts
from specdec.config import PrecisionPlan, RuntimeConfig
from specdec.models import load_model
from specdec.models.precision import apply_plan

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PPL_FILES = (STDLIB / "LICENSE.txt", STDLIB / "functools.py")
DEFAULT_PLANS = (
    "fp32",
    "bf16",
    "attention=bfloat16,ffn=bfloat16,head=int8",
    "attention=bfloat16,ffn=int8,head=bfloat16",
    "attention=bfloat16,ffn=int8,head=int8",
    "attention=int8,ffn=int8,head=int8",
    "fp8-draft",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plans", nargs="*", default=DEFAULT_PLANS)
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--prompts", default="core")
    parser.add_argument("--out")
    args = parser.parse_args()
    prompts = [p.prompt for p in load_prompts(args.prompts)]
    reference = load_model(args.target)
    texts = {f.name: read_tokens(reference.tokenizer, str(f), 4096) for f in PPL_FILES}
    float32_nll = {name: score(reference.model, tokens, 512, lambda *a: None, "") for name, tokens in texts.items()}
    del reference
    rows = []
    for spec in args.plans:
        plan = PrecisionPlan.parse(spec)
        model = load_model(args.target)
        apply_plan(model.model, plan)
        generator = Generator(model, "none", runtime=RuntimeConfig(precision=plan))
        generator.generate(prompts[0], max_new_tokens=8)  # warm-up
        started, tokens = time.perf_counter(), 0
        for prompt in prompts:
            tokens += generator.generate(prompt, max_new_tokens=32, stop_on_eos=False).stats.new_tokens
        speed = tokens / (time.perf_counter() - started)
        ppl = {}
        for name, ids in texts.items():
            nll = score(model.model, ids, 512, lambda *a: None, "")
            ppl[name] = {"float32": 2.718281828 ** float32_nll[name], "plan": 2.718281828**nll}
        rows.append({"plan": spec, "describe": plan.describe(), "tokens_per_s": speed, "perplexity": ppl})
        deltas = ", ".join(f"{n} {v['plan']:.3f} ({v['plan'] - v['float32']:+.3f})" for n, v in ppl.items())
        print(f"{spec:45s} {speed:6.1f} tok/s  ppl {deltas}", flush=True)
        del generator, model
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
