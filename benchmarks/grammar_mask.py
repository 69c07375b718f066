"""What structured output costs and whether speculation still pays under a JSON schema (Gemma-3-270M, native).

    python benchmarks/grammar_mask.py --out benchmarks/results/DATE-cpu-grammar-mask.json

1. Per-token mask cost of llguidance (the engine's) and, when installed, xgrammar (optional, not a dependency), walking
   valid JSON documents of the schemas below: fill the next token's bitmask, then consume the token.
2. The engine's own cost per verified position (`Constraint.mask`, bitmasks filled and applied to [n + 1, 262144]
   logits), timed inside the runs of 3.
3. Greedy requests of 64 new tokens under each prompt's JSON schema, target-only against `auto`, prompt lookup and
   suffix (cost-model k 8), and the same requests without a schema. Prompts are extraction requests written here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from specdec import GenerationConfig, Generator
from specdec.config import Grammar, RuntimeConfig
from specdec.grammar import Constraint
from specdec.models import load_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "status", "items"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "day": {"type": "string"}, "room": {"type": "string"}},
    "required": ["title", "day", "room"],
    "additionalProperties": False,
}
DOCUMENTS = [
    (PERSON, {"name": "Marta Oliveira", "age": 41, "city": "Porto", "skills": ["welding", "sailing", "Python"]}),
    (ORDER, {"order_id": "A-7731", "status": "shipped", "items": [{"sku": "KB-12", "quantity": 2}]}),
    (EVENT, {"title": "Quarterly review", "day": "Thursday", "room": "3C"}),
]
PROMPTS = [
    (PERSON, "Marta Oliveira is 41 and lives in Porto. She welds, sails and writes Python.\nThe person as JSON:"),
    (PERSON, "Kenji Ito, 29, moved to Osaka last year; he knows carpentry and Go.\nThe person as JSON:"),
    (ORDER, "Order A-7731 was shipped: two KB-12 keyboards and one MS-3 mouse.\nThe order as JSON:"),
    (ORDER, "Order Z-1002 is still pending, with 5 units of sku PEN-9.\nThe order as JSON:"),
    (EVENT, "The quarterly review is on Thursday in room 3C, after lunch.\nThe event as JSON:"),
    (EVENT, "Team lunch: Friday, room Atrium, bring a dish.\nThe event as JSON:"),
]
DRAFTS = ["none", "auto", "prompt-lookup", "suffix"]


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def llguidance_walk(tokenizer, documents) -> dict:
    import llguidance
    import llguidance.hf
    import numpy as np

    start = time.perf_counter()
    table = llguidance.hf.from_tokenizer(tokenizer)
    setup_s = time.perf_counter() - start
    bitmask = np.zeros((table.vocab_size + 31) // 32, dtype=np.int32)
    times, compile_s = [], []
    for schema, value in documents:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(table, llguidance.grammar_from("json_schema", json.dumps(schema)))
        compile_s.append(time.perf_counter() - start)
        for token in tokenizer.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False):
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token), matcher.get_error()
    return _summary(times, setup_s, compile_s)


def xgrammar_walk(tokenizer, documents, vocab_size: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar is not installed: its column is left out (pip install xgrammar to compare)")
        return None
    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    setup_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times, compile_s = [], []
    for schema, value in documents:
        start = time.perf_counter()
        matcher = xgr.GrammarMatcher(
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        )
        compile_s.append(time.perf_counter() - start)
        for token in tokenizer.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token)
    return _summary(times, setup_s, compile_s)


def _summary(times: list[float], setup_s: float, compile_s: list[float]) -> dict:
    return {
        "tokens": len(times),
        "mask_us_median": statistics.median(times) * 1e6,
        "mask_us_mean": statistics.fmean(times) * 1e6,
        "tokenizer_table_s": setup_s,
        "compile_ms_mean": statistics.fmean(compile_s) * 1e3,
    }


def timed_masks() -> tuple[list[float], list[int]]:
    """Wrap Constraint.mask to record its seconds and positions per call."""
    seconds, positions = [], []
    real = Constraint.mask

    def mask(self, logits, drafts, links):
        start = time.perf_counter()
        real(self, logits, drafts, links)
        seconds.append(time.perf_counter() - start)
        positions.append(logits.shape[0])

    Constraint.mask = mask  # type: ignore[method-assign]
    return seconds, positions


def requests(repeats: int) -> dict:
    runtime = RuntimeConfig(backend="native")
    seconds, positions = timed_masks()
    rows = {}
    for draft in DRAFTS:
        gen = Generator("gemma-3-270m", draft, GenerationConfig(max_new_tokens=64), runtime)
        gen.generate(PROMPTS[0][1], max_new_tokens=16, grammar=Grammar("json"))  # warm-up, not counted
        for schema_on in (True, False):
            tokens, wall, accepted, proposed = 0, 0.0, 0, 0
            for prompt_schema, prompt in PROMPTS:
                grammar = Grammar("json_schema", json.dumps(prompt_schema)) if schema_on else None
                runs = [gen.generate(prompt, max_new_tokens=64, grammar=grammar) for _ in range(repeats)]
                best = min(runs, key=lambda r: r.stats.wall_s)
                tokens += best.stats.new_tokens
                wall += best.stats.wall_s
                accepted += best.stats.draft_tokens_accepted
                proposed += best.stats.draft_tokens_proposed
            rows[(draft, schema_on)] = {
                "tokens_per_s": tokens / wall,
                "acceptance": accepted / proposed if proposed else 0.0,
                "tokens": tokens,
            }
    mask_us_per_position = 1e6 * sum(seconds) / max(1, sum(positions))
    return {"rows": rows, "mask_us_per_position": mask_us_per_position, "mask_calls": len(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tokenizer = load_model("gemma-3-270m").tokenizer
    engines = {"llguidance": llguidance_walk(tokenizer, DOCUMENTS)}
    xgr = xgrammar_walk(tokenizer, DOCUMENTS, len(tokenizer))
    if xgr is not None:
        engines["xgrammar"] = xgr
    for name, row in engines.items():
        print(
            f"{name}: mask {row['mask_us_median']:.1f} us median, {row['mask_us_mean']:.1f} mean over {row['tokens']} "
            f"tokens; tokenizer table {row['tokenizer_table_s']:.2f} s, compile {row['compile_ms_mean']:.1f} ms"
        )
    served = requests(args.repeats)
    rows = served["rows"]
    base = {on: rows[("none", on)]["tokens_per_s"] for on in (True, False)}
    table = []
    for (draft, on), row in rows.items():
        ratio = row["tokens_per_s"] / base[on]
        table.append({"draft": draft, "schema": on, **row, "vs_target_only": ratio})
        print(
            f"{draft:14s} schema={on!s:5s} {row['tokens_per_s']:6.1f} tok/s  {ratio:.2f}x  acc {row['acceptance']:.0%}"
        )
    print(
        f"Constraint.mask: {served['mask_us_per_position']:.1f} us per verified position ({served['mask_calls']} calls)"
    )
    result = {
        "kind": "grammar-mask",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "command": f"python benchmarks/grammar_mask.py --repeats {args.repeats} --out {args.out}",
        "engines": engines,
        "requests": table,
        "mask_us_per_position": served["mask_us_per_position"],
        "prompts": len(PROMPTS),
        "new_tokens": 64,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
