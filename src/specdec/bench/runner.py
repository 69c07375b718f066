"""Run every method on the same prompts in one process and aggregate honest figures.

Methods take turns prompt by prompt, in an order rotated per prompt and repeat, so that machine drift falls evenly;
model loading and one warm-up generation per method are excluded from timings.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from specdec.bench.memory import PeakMemory, current_bytes
from specdec.bench.methods import (
    K_FREE_METHODS,
    PEER_PREFIXES,
    Method,
    RunRecord,
    build_method,
    check_method,
)
from specdec.bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts
from specdec.config import GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.engine.costs import forward_cost_curve
from specdec.errors import ConfigError, SpecDecError
from specdec.machine import cpu_name
from specdec.models import DEFAULT_TARGET, load_model, open_target

DEFAULT_METHODS = (
    "none",
    "prompt-lookup",
    "oracle",
    "hf-greedy",
    "hf-prompt-lookup",
    "llamacpp-greedy",
    "llamacpp-prompt-lookup",
)


@dataclass(frozen=True)
class BenchConfig:
    prompts: str = DEFAULT_PROMPTS
    target: str = DEFAULT_TARGET
    methods: tuple[str, ...] = DEFAULT_METHODS
    ks: tuple[int, ...] = (4,)
    k_policies: tuple[str, ...] = ("fixed",)  # specdec's drafters run once per k and policy
    max_new_tokens: int = 64
    temperature: float = 0.0
    repeats: int = 1
    seed: int = 0
    runtime: RuntimeConfig = RuntimeConfig()  # where specdec's methods run the target
    strict: bool = False
    quick: bool = False

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if not self.methods:
            raise ConfigError("no methods given: pass --methods none,prompt-lookup,...")
        for k in self.ks:
            for policy in self.k_policies:
                GenerationConfig(k=k, k_policy=policy)  # validates both


def method_plan(config: BenchConfig, specs: list[str]) -> list[tuple[str, int, str]]:
    """(method, k, k policy) for every method that runs: k-free ones once, peers per k, specdec's per k and policy."""
    plan = []
    for spec in specs:
        ks = config.ks[:1] if spec in K_FREE_METHODS else config.ks
        policies = (
            config.k_policies if spec not in K_FREE_METHODS and not spec.startswith(PEER_PREFIXES) else ("fixed",)
        )
        plan += [(spec, k, policy) for k in ks for policy in policies]
    return plan


class GreedyMismatchError(SpecDecError):
    """--strict: a method's greedy output differed from target-only output."""


@dataclass
class MethodRuns:
    method: Method
    static_bytes: int  # memory its own models added when built
    peak_bytes: int = 0  # peak above the idle level while it ran
    records: dict[int, list[tuple[BenchPrompt, RunRecord]]] = field(default_factory=dict)  # repeat -> runs


WARM_UP = "A few words to warm up every method before the measured prompts:"


def run_benchmark(config: BenchConfig, advance: Callable[[str], None] = lambda _: None) -> dict:
    """Run the benchmark; ``advance`` is called once per generation (for a progress bar)."""
    skipped = {spec: check_method(spec, config.target) for spec in config.methods}
    notes = [note for note in skipped.values() if note]
    specs = ["none"] + [s for s, note in skipped.items() if s != "none" and note is None]
    prompts = load_prompts(config.prompts)
    max_new = config.max_new_tokens
    if config.quick:
        prompts, max_new = prompts[:2], min(max_new, 16)

    runtime = config.runtime
    needs_hf = runtime.backend == "transformers" or any(s.startswith("hf-") for s in specs)
    hf_model = load_model(config.target, dtype="float32" if runtime.precision else runtime.dtype) if needs_hf else None
    target = open_target(
        hf_model if hf_model is not None and runtime.backend == "transformers" else config.target, runtime
    )
    if target.tokenizer is None:
        raise ConfigError(f"target '{config.target}' has no tokenizer; the benchmark needs one to encode prompts")
    prompt_ids = {p.id: target.tokenizer(p.prompt)["input_ids"] for p in prompts}
    sampling = SamplingConfig(temperature=config.temperature)
    loaded_bytes = current_bytes()  # the process with the target loaded: every method's floor

    runs: list[MethodRuns] = []
    for spec, k, policy in method_plan(config, specs):
        gen_config = GenerationConfig(k=k, k_policy=policy, max_new_tokens=max_new, sampling=sampling, seed=config.seed)
        before = current_bytes()
        method = build_method(spec, target, hf_model, gen_config, runtime)
        runs.append(MethodRuns(method, max(0, current_bytes() - before)))

    learning = [e.method.name for e in runs if e.method.learns]
    if learning and config.repeats > 1:
        raise ConfigError(
            f"{', '.join(learning)} drafts from the answers it has given, so a repeat would copy the first pass: "
            "run it with --repeats 1"
        )
    cost_curve = forward_cost_curve(target.backend)  # measured before any method runs, on a quiet process
    baseline = runs[0].method
    references = {p.id: baseline.run(prompt_ids[p.id], None).token_ids for p in prompts}  # also warms up `none`
    warm_up = target.tokenizer(WARM_UP)["input_ids"]  # not a measured prompt: a learning drafter would keep its answer
    for entry in runs[1:]:
        entry.method.run(warm_up, None)
    # Methods take turns on each prompt, in an order rotated per prompt and repeat, so drift hits all alike.
    for repeat in range(config.repeats):
        for index, p in enumerate(prompts):
            shift = (repeat + index) % len(runs)
            for entry in runs[shift:] + runs[:shift]:
                idle = current_bytes()
                with PeakMemory() as peak:
                    record = entry.method.run(prompt_ids[p.id], references[p.id])
                entry.records.setdefault(repeat, []).append((p, record))
                entry.peak_bytes = max(entry.peak_bytes, peak.peak - idle)
                advance(entry.method.name)

    results = _aggregate(config, runs, prompts, max_new, loaded_bytes)
    results["notes"] = notes
    results["target_forward_cost_ms"] = {n: 1000 * seconds for n, seconds in cost_curve.items()}
    if config.strict and sampling.greedy:
        bad = [m for m in results["greedy_mismatches"] if m["method"] != "none"]
        if bad:
            first = bad[0]
            raise GreedyMismatchError(
                f"{len(bad)} greedy output(s) differ from target-only decoding, first: {first['method']} on "
                f"prompt '{first['prompt']}' at token {first['first_difference']}"
            )
    return results


def machine_info(runtime: RuntimeConfig) -> dict[str, object]:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": runtime.precision.describe()
        if runtime.precision
        else "int8a8"
        if runtime.backend == "native"
        else runtime.dtype,
        "backend": runtime.backend,
        "threads": runtime.threads,
        "python": platform.python_version(),
    }


def _summary(entry: MethodRuns, items: set[str]) -> dict[str, object]:
    """Figures of one method over the prompts whose ids are in ``items``."""
    per_repeat = []
    everything: list[RunRecord] = []
    for records in entry.records.values():
        chosen = [r for p, r in records if p.id in items]
        everything += chosen
        per_repeat.append(sum(len(r.token_ids) for r in chosen) / max(sum(r.wall_s for r in chosen), 1e-9))
    tokens = sum(len(r.token_ids) for r in everything)
    proposed = sum(r.draft_tokens_proposed or 0 for r in everything)
    accepted = sum(r.draft_tokens_accepted or 0 for r in everything)
    steps = sum(r.target_steps or 0 for r in everything)
    later_steps = sum(max((r.target_steps or 0) - 1, 0) for r in everything)  # verify_s leaves out the first step
    spec = everything[0].target_steps is not None
    ttfts = [r.ttft_s for r in everything if r.ttft_s is not None]
    draft_ms = sorted(1000 * t for r in everything for t in r.draft_s_per_step)
    return {
        "tokens_per_s": statistics.median(per_repeat),
        "tokens_per_s_min": min(per_repeat),
        "tokens_per_s_max": max(per_repeat),
        "new_tokens": tokens // len(entry.records),
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_per_step": accepted / steps if spec and steps else None,
        "tokens_per_step": tokens / steps if spec and steps else None,
        "target_forwards_per_token": steps / tokens if spec and tokens else None,
        "ttft_s": statistics.median(ttfts) if ttfts else None,
        "draft_s_per_token": sum(r.draft_s or 0 for r in everything) / proposed if proposed else None,
        "verify_s_per_step": sum(r.verify_s or 0 for r in everything) / later_steps if spec and later_steps else None,
        "mean_proposed_per_step": proposed / steps if spec and steps else None,
        "draft_ms_p50": _percentile(draft_ms, 0.5),
        "draft_ms_p99": _percentile(draft_ms, 0.99),
    }


POSITION_GROUP = 3  # prompts per point of the curve over the run's order


def _by_position(runs: list[MethodRuns], prompts: list[BenchPrompt]) -> dict[str, list[dict]]:
    """Per method, speed-up over target-only and tokens per step by the prompts' position in their category (in run
    order, POSITION_GROUP at a time): how a drafter that learns from earlier answers improves along the run."""
    position: dict[str, int] = {}
    seen: Counter[str] = Counter()
    for p in prompts:
        position[p.id] = seen[p.category]
        seen[p.category] += 1
    groups: dict[int, set[str]] = {}
    for item, index in position.items():
        groups.setdefault(index // POSITION_GROUP, set()).add(item)
    curves: dict[str, list[dict]] = {}
    for entry in runs:
        curve = []
        for group, items in sorted(groups.items()):
            row, base = _summary(entry, items), _summary(runs[0], items)
            first, last = group * POSITION_GROUP + 1, group * POSITION_GROUP + POSITION_GROUP
            curve.append(
                {
                    "positions": f"{first}-{last}",
                    "speedup_vs_none": row["tokens_per_s"] / base["tokens_per_s"],
                    "tokens_per_step": row["tokens_per_step"],
                }
            )
        curves[entry.method.name] = curve
    return curves


def _percentile(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank), or None when there are none."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def _predicted(row: dict, base: dict) -> tuple[float | None, float | None]:
    """Leviathan et al. (2023): expected tokens per step over the cost of a step.

    The first figure uses the paper's idealisation (verifying k tokens costs one
    target step); the second uses this machine's measured verification cost.
    """
    a, k = row["acceptance_rate"], row["mean_proposed_per_step"]
    if a is None or k is None or not base["verify_s_per_step"]:
        return None, None
    expected = (k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    c = row["draft_s_per_token"] / base["verify_s_per_step"]
    verify_ratio = row["verify_s_per_step"] / base["verify_s_per_step"]
    return expected / (k * c + 1), expected / (k * c + verify_ratio)


def _aggregate(
    config: BenchConfig, runs: list[MethodRuns], prompts: list[BenchPrompt], max_new: int, loaded_bytes: int
) -> dict:
    categories = {"overall": {p.id for p in prompts}}
    for p in prompts:
        categories.setdefault(p.category, set()).add(p.id)
    base, own_greedy = runs[0], {"transformers": "hf-greedy", "llama.cpp": "llamacpp-greedy"}
    summaries = {e.method.name: {c: _summary(e, items) for c, items in categories.items()} for e in runs}
    base_rows = summaries[base.method.name]
    methods = {}
    for entry in runs:
        m = entry.method
        rows = summaries[m.name]
        peer_rows = summaries.get(own_greedy.get(m.family, ""))
        for category, row in rows.items():
            row["speedup_vs_none"] = row["tokens_per_s"] / base_rows[category]["tokens_per_s"]
            row["speedup_vs_own_greedy"] = (
                row["tokens_per_s"] / peer_rows[category]["tokens_per_s"] if peer_rows else None
            )
            row["predicted_speedup"], row["predicted_speedup_measured_costs"] = _predicted(row, base_rows[category])
        histogram = Counter(n for records in entry.records.values() for _, r in records for n in r.accepted_per_step)
        k_histogram = Counter(
            n for records in entry.records.values() for _, r in records for n in r.k_per_step if m.k is not None
        )
        peak = loaded_bytes + entry.static_bytes + entry.peak_bytes
        base_peak = loaded_bytes + base.static_bytes + base.peak_bytes
        methods[m.name] = {
            "family": m.family,
            "k": m.k,
            "peak_memory_mb": peak / 2**20,
            "peak_memory_increase_vs_none_mb": (peak - base_peak) / 2**20,
            "peak_memory_increase_vs_none": (peak - base_peak) / base_peak,
            "k_policy": m.k_policy,
            "accepted_per_step_histogram": dict(sorted(histogram.items())),
            "k_histogram": dict(sorted(k_histogram.items())),
            "categories": rows,
        }
    mismatches = []
    first_repeat = {p.id: r.token_ids for p, r in base.records[0]}
    for entry in runs:
        differing = set()
        for p, r in entry.records[0]:
            expected = first_repeat[p.id]
            if r.token_ids != expected:
                differing.add(p.id)
                diff = next(
                    (i for i, (a, b) in enumerate(zip(r.token_ids, expected, strict=False)) if a != b),
                    min(len(r.token_ids), len(expected)),
                )
                mismatches.append({"method": entry.method.name, "prompt": p.id, "first_difference": diff})
        for category, items in categories.items():
            methods[entry.method.name]["categories"][category]["identical_share"] = 1 - len(differing & items) / len(
                items
            )
    return {
        "config": asdict(config) | {"max_new_tokens_used": max_new, "prompt_count": len(prompts)},
        "positions": _by_position(runs, prompts),
        "machine": machine_info(config.runtime),
        "categories": sorted(categories, key=lambda c: (c != "overall", c)),
        "methods": methods,
        "greedy_mismatches": mismatches,
        "greedy_identical_share": {name: m["categories"]["overall"]["identical_share"] for name, m in methods.items()},
    }
