"""The batching benchmark: the fixed against the dynamic k_cap (the batch's cap on k) at several batch sizes.

For each batch size B, B prompts of the set (taken in turn from each category) are decoded together
by batched target-only decoding, by speculation under the fixed k_cap (every
row drafts k each step) and under the dynamic k_cap (scheduling/k_cap.py),
and, as the baseline batching must beat, one request at a time. All methods
run in one process on the same machine; figures are ratios within the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts, round_robin
from specdec.bench.report import fmt, machine_line
from specdec.bench.runner import machine_info
from specdec.config import DEFAULT_DRAFT, BatchConfig, GenerationConfig, RuntimeConfig
from specdec.drafters import Drafter, build_drafter
from specdec.engine import GenerationResult, Generator
from specdec.errors import ConfigError
from specdec.models import DEFAULT_TARGET, open_target


@dataclass(frozen=True)
class BatchBenchConfig:
    prompts: str = DEFAULT_PROMPTS
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    batch_sizes: tuple[int, ...] = (8, 16, 32)
    k: int = 5  # every row's k under the fixed k_cap, the most the dynamic k_cap allows
    max_new_tokens: int = 64
    sequential: bool = True  # also decode the requests one at a time
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"batch sizes must be positive integers, got {self.batch_sizes}")
        if self.draft == "none":
            raise ConfigError("the batching benchmark compares caps on k: pass a drafter (--draft prompt-lookup)")


METHODS = ("target-only", "fixed k_cap", "dynamic k_cap", "one at a time")


def run_batch_benchmark(config: BatchBenchConfig, advance: Callable[[str], None] = lambda _: None) -> dict:
    """Decode each batch with every method; return figures per batch size and method."""
    prompts = round_robin(load_prompts(config.prompts))
    target = open_target(config.target, config.runtime)
    sequential = Generator(
        target,
        config.draft,
        GenerationConfig(k=config.k, k_policy="cost-model", max_new_tokens=config.max_new_tokens),
        config.runtime,
    )
    if sequential.drafter.capabilities.learns and max(config.batch_sizes) > len(prompts):
        raise ConfigError(
            f"a batch of {max(config.batch_sizes)} repeats some of the {len(prompts)} prompts, and "
            f"'{sequential.draft_name}' learns from the answers it drafted: decoded one at a time, a repeat would copy "
            "its first answer. Use batch sizes up to the prompt count, more prompts, or --draft prompt-lookup"
        )
    fixed = GenerationConfig(k=config.k, k_policy="fixed", max_new_tokens=config.max_new_tokens)
    k_caps = {"fixed k_cap": "fixed", "dynamic k_cap": "dynamic"}

    def fresh() -> dict[str, Generator]:
        """The drafting methods' generators. ``auto`` is made concrete once (``sequential``); a drafter that learns
        from the answers it drafted (suffix) is new for every batch and method, so none copies another's answers."""
        learns = sequential.drafter.capabilities.learns

        def drafter() -> Drafter:
            return build_drafter(sequential.draft_name, target, config.runtime) if learns else sequential.drafter

        one = Generator(target, drafter(), sequential.config, config.runtime) if learns else sequential
        return {"one at a time": one} | {
            name: Generator(target, drafter(), fixed, batch=BatchConfig(k_cap=k_cap)) for name, k_cap in k_caps.items()
        }

    target_only = Generator(target, "none", fixed, batch=BatchConfig(k_cap="fixed"))  # nothing to cap
    warm = [p.prompt for p in prompts[:2]]
    fresh()["dynamic k_cap"].generate_batch(warm, max_new_tokens=4)  # measures the batch cost curve once (cached)
    sequential.generate(warm[0], max_new_tokens=4)  # measures the single-sequence cost curve once (cached)

    results: dict[str, dict] = {}
    for size in config.batch_sizes:
        batch = [prompts[i % len(prompts)].prompt for i in range(size)]
        figures: dict[str, dict] = {}
        reference: list[list[int]] | None = None
        generators = fresh()
        for name in METHODS:
            if name == "one at a time" and not config.sequential:
                continue
            advance(f"batch {size}: {name}")
            if name == "target-only":
                outputs, latencies, wall, caps = _together(target_only, batch)
            elif name == "one at a time":
                outputs, latencies, wall, caps = _one_at_a_time(generators[name], batch)
            else:
                outputs, latencies, wall, caps = _together(generators[name], batch)
            ids = [o.token_ids for o in outputs]
            reference = reference or ids
            figures[name] = _figures(outputs, latencies, wall, caps, ids, reference)
        base = figures["target-only"]["tokens_per_s"]
        for entry in figures.values():
            entry["throughput_vs_target_only"] = entry["tokens_per_s"] / base if base else None
        for statistic in ("mean", "p50", "p99"):
            fixed_latency = figures["fixed k_cap"][f"{statistic}_latency_s"]
            figures["dynamic k_cap"][f"{statistic}_latency_cut_vs_fixed"] = (
                1 - figures["dynamic k_cap"][f"{statistic}_latency_s"] / fixed_latency
            )
        results[str(size)] = figures
    return {
        "machine": machine_info(config.runtime),
        "config": asdict(config) | {"runtime": str(config.runtime)},
        "batches": results,
    }


def _together(generator: Generator, batch: list[str]) -> tuple[list[GenerationResult], list[float], float, list[int]]:
    decoder = generator.batch_decoder(len(batch))
    start = time.perf_counter()
    outputs = generator.generate_batch(batch, decoder=decoder)
    wall = time.perf_counter() - start
    caps = [r.k_cap for r in decoder.reports if r.k_cap is not None]
    return outputs, [o.stats.wall_s for o in outputs], wall, caps


def _one_at_a_time(
    generator: Generator, batch: list[str]
) -> tuple[list[GenerationResult], list[float], float, list[int]]:
    """Requests served in arrival order: each one's latency includes waiting for those before it."""
    start = time.perf_counter()
    outputs, latencies = [], []
    for prompt in batch:
        outputs.append(generator.generate(prompt))
        latencies.append(time.perf_counter() - start)
    return outputs, latencies, time.perf_counter() - start, []


def _figures(
    outputs: list[GenerationResult],
    latencies: list[float],
    wall: float,
    caps: list[int],
    ids: list[list[int]],
    reference: list[list[int]],
) -> dict:
    tokens = sum(len(o.token_ids) for o in outputs)
    proposed = sum(o.stats.draft_tokens_proposed for o in outputs)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {
        "requests": len(outputs),
        "new_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "mean_latency_s": statistics.fmean(latencies),
        "p50_latency_s": cuts[49],
        "p95_latency_s": cuts[94],
        "p99_latency_s": cuts[98],
        "ms_per_token": 1000
        * statistics.fmean(lat / max(len(o.token_ids), 1) for lat, o in zip(latencies, outputs, strict=True)),
        "acceptance_rate": sum(o.stats.draft_tokens_accepted for o in outputs) / proposed if proposed else None,
        "mean_k_cap": statistics.fmean(caps) if caps else None,
        "steps_without_speculation": sum(c == 0 for c in caps) / len(caps) if caps else None,
        "identical_share": sum(a == b for a, b in zip(ids, reference, strict=True)) / len(ids),
    }


def markdown(results: dict) -> str:
    machine, cfg = results["machine"], results["config"]
    lines = [
        "# specdec batching benchmark",
        "",
        f"Target `{cfg['target']}` ({machine['dtype']}), drafter `{cfg['draft']}`, k = {cfg['k']}, "
        f"up to {cfg['max_new_tokens']} new tokens per request, prompts from `{cfg['prompts']}`.",
        machine_line(machine),
        "",
        "Latency: from the batch's start to a request's last token "
        "(one at a time: including the wait for earlier requests).",
        "Identical: share of requests whose output equals batched target-only's.",
        "",
    ]
    for size, figures in results["batches"].items():
        lines += [
            f"## batch {size}",
            "",
            "| method | tok/s | vs target-only | latency mean / p50 / p99 s | ms/token | acceptance | mean k_cap "
            "| steps w/o drafts | identical |",
            "|" + "---|" * 9,
        ]
        for name, f in figures.items():
            lines.append(
                f"| {name} | {f['tokens_per_s']:.1f} | {f['throughput_vs_target_only']:.2f}x "
                f"| {f['mean_latency_s']:.2f} / {f['p50_latency_s']:.2f} / {f['p99_latency_s']:.2f} "
                f"| {f['ms_per_token']:.0f} "
                f"| {fmt(f['acceptance_rate'], '{:.0%}')} | {fmt(f['mean_k_cap'], '{:.1f}')} "
                f"| {fmt(f['steps_without_speculation'], '{:.0%}')} | {f['identical_share']:.0%} |"
            )
        cuts = [f"{figures['dynamic k_cap'][f'{s}_latency_cut_vs_fixed']:.0%}" for s in ("mean", "p50", "p99")]
        lines += [
            "",
            f"The dynamic k_cap cuts latency (mean / p50 / p99) by {' / '.join(cuts)} against the fixed k_cap "
            "(negative: it adds latency).",
            "",
        ]
    return "\n".join(lines)
