"""`specdec tune`: the fastest exact configuration for this machine, target and prompts, found within a time budget.

Whether speculation pays depends on three things no default can know: the runtime's price of verifying n tokens
on this machine, the drafter's acceptance on the user's text, and the drafter's own cost. The search measures
each, predicts every configuration from them, and lets a real run decide among the best predicted:

1. runtimes: the target opens on each runtime that runs here; its forward cost curve is measured, and a short
   target-only run gives its tokens/s and the engine's per-step cost outside the forward;
2. drafters: each drafts chains of max_k tokens on a sample of the prompts, on the fastest runtime it runs on,
   and every step's proposed and accepted tokens and drafting time are kept;
3. prediction: those steps are replayed on every runtime's curve for every k up to max_k (a step that accepted
   a tokens of p keeps min(a, k) of min(p, k)); acceptance is assumed the same on every runtime;
4. confirmation: the best predicted configurations, the cost-model policy for the best, and each of their
   runtimes' target-only run on the same prompts, taking turns; the fastest measured is the profile. Target-only
   is a candidate, so the profile is never slower than target-only was measured to be.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specdec.bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts
from specdec.config import PRESETS, TREE_BRANCHES, TREE_SUFFIX, GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.drafters import build_drafter
from specdec.engine import Generator
from specdec.engine.costs import forward_cost_curve
from specdec.errors import ConfigError, PromptError, SpecDecError
from specdec.machine import fingerprint
from specdec.models import DEFAULT_TARGET, Target, open_target, resolve
from specdec.models.cpu_kernels import vnni_available
from specdec.models.registry import bundled_draft
from specdec.profile import Profile
from specdec.scheduling import CostCurve

MIN_BUDGET_S = 30.0  # below this not even one runtime's curve and a short run fit
PHASE_ENDS = (0.3, 0.6)  # shares of the budget by which runtime measurement, then drafter sampling, stop starting work
SECONDS_PER_PROMPT = 50.0  # the budget buys one sampled prompt per this many seconds (at least 2, at most the set)
PROBE_PROMPTS = 2  # prompts of each runtime's target-only run


@dataclass(frozen=True)
class TuneConfig:
    """What to tune for and how long to look. Empty ``runtimes``/``drafters``: everything that runs here."""

    target: str = DEFAULT_TARGET
    prompts: str = DEFAULT_PROMPTS
    budget_s: float = 600.0
    temperature: float = 0.0  # 0 tunes greedy decoding; > 0 tunes sampling at that temperature
    max_k: int = 8
    runtimes: tuple[str, ...] = ()
    drafters: tuple[str, ...] = ()
    new_tokens: int = 32  # per prompt, in the sampling and confirmation runs
    confirm: int = 3  # best predicted (runtime, drafter) pairs confirmed by a real run
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget_s < MIN_BUDGET_S:
            raise ConfigError(
                f"--budget-s {self.budget_s:g} is too small to measure anything: one runtime's cost curve and a short run take "
                f"about {MIN_BUDGET_S:.0f} s; give at least {MIN_BUDGET_S:.0f} (the default, 600, measures every runtime and drafter)"
            )
        GenerationConfig(k=self.max_k, sampling=SamplingConfig(self.temperature))  # validates both
        if self.new_tokens < 8 or self.confirm < 1:
            raise ConfigError(f"new_tokens must be >= 8 and confirm >= 1, got {self.new_tokens} and {self.confirm}")


@dataclass
class RuntimeFigures:
    label: str
    runtime: RuntimeConfig
    target: Target
    curve: CostCurve
    target_only_tokens_per_s: float
    overhead_s: float  # per step, outside the forward (the engine, sampling, bookkeeping)
    load_s: float


@dataclass
class DrafterSample:
    spec: str  # as given: "prompt-lookup", "prompt-lookup+tree"
    runtime: str  # the runtime label it was sampled on
    steps: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted) of every step after the first
    draft_s_per_step: float = 0.0  # mean, at max_k

    @property
    def drafter(self) -> str:
        return self.spec.removesuffix(TREE_SUFFIX)

    @property
    def tree(self) -> bool:
        return self.spec.endswith(TREE_SUFFIX)


@dataclass
class Candidate:
    runtime: str
    drafter: str  # a spec, "none" for target-only
    k: int  # 1 for target-only (a GenerationConfig's least; nothing is drafted)
    k_policy: str
    predicted_tokens_per_s: float
    measured_tokens_per_s: float | None = None
    measured_by_category: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        depth = "" if self.drafter == "none" else f" {self.k_policy} k={self.k}"
        return f"{self.runtime} / {self.drafter}{depth}"


def runtime_candidates(target: str) -> dict[str, RuntimeConfig]:
    """Every runtime and precision plan worth measuring for ``target`` here, fastest measured first (BENCHMARKS.md)."""
    import importlib.util

    import torch

    found: dict[str, RuntimeConfig] = {}
    cuda = torch.cuda.is_available()
    if not cuda and vnni_available():
        found["native"] = RuntimeConfig(backend="native")
    if importlib.util.find_spec("llama_cpp") is not None and resolve(target).kind in ("alias", "gguf"):
        found["llama.cpp"] = RuntimeConfig(backend="llama.cpp")
    if cuda:
        found["transformers/bf16"] = RuntimeConfig(precision=PRESETS["bf16"])
    elif vnni_available():
        found["transformers/cpu-vnni"] = RuntimeConfig(precision=PRESETS["cpu-vnni"])
    if not cuda:
        found["transformers/cpu"] = RuntimeConfig(precision=PRESETS["cpu"])
    found["transformers/float32"] = RuntimeConfig()
    return found


def drafter_candidates(target: str) -> list[str]:
    """prompt-lookup, and the drafts shipped for ``target``."""
    found = ["prompt-lookup"]
    if bundled_draft(target) is not None:
        found.append("lookup-then-draft")
    if bundled_draft(target, "eagle") is not None:
        found += ["eagle", "lookup-then-eagle"]
    return found


def plan(config: TuneConfig) -> tuple[dict[str, RuntimeConfig], list[str], int]:
    """The runtimes and drafters the search will try (checked against what exists), and its units of progress."""
    available = runtime_candidates(config.target)
    if config.runtimes:
        unknown = [r for r in config.runtimes if r not in available]
        if unknown:
            raise ConfigError(f"runtime(s) {', '.join(unknown)} cannot run '{config.target}' here: choose among {', '.join(available)}")
        available = {r: available[r] for r in config.runtimes}
    drafters = list(config.drafters) or drafter_candidates(config.target)
    if "none" in drafters:
        drafters.remove("none")  # target-only is always a candidate
    return available, drafters, len(available) + len(drafters) + 1


def sample_prompts(prompts: list[BenchPrompt], count: int) -> list[BenchPrompt]:
    """Up to ``count`` prompts taken in turn from each category, so that every category is represented."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    chosen: list[BenchPrompt] = []
    while len(chosen) < min(count, len(prompts)):
        for items in by_category.values():
            taken = sum(p.category == items[0].category for p in chosen)
            if taken < len(items) and len(chosen) < count:
                chosen.append(items[taken])
    return chosen


def tune(config: TuneConfig, advance: Callable[[str], None] = lambda _: None) -> tuple[Profile, dict]:
    """Search; return the profile of the fastest measured configuration and every figure behind the choice."""
    start = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - start

    runtimes, drafters, _ = plan(config)
    sampling = SamplingConfig(config.temperature)
    base = GenerationConfig(k=1, k_policy="fixed", max_new_tokens=config.new_tokens, sampling=sampling, seed=config.seed)
    notes: list[str] = []

    measured: dict[str, RuntimeFigures] = {}
    prompts: list[tuple[BenchPrompt, list[int]]] = []
    for label, runtime in runtimes.items():
        if measured and elapsed() > PHASE_ENDS[0] * config.budget_s:
            notes.append(f"runtime {label} not measured: the budget's share for runtimes was spent")
            advance(f"{label} skipped (budget)")
            continue
        try:
            figures, prompts = _measure_runtime(label, runtime, config, base, prompts)
        except PromptError:
            raise  # the prompts are unusable on every runtime
        except SpecDecError as exc:
            notes.append(f"runtime {label} skipped: {exc}")
            advance(f"{label} skipped")
            continue
        measured[label] = figures
        advance(f"{label}: {figures.target_only_tokens_per_s:.1f} tok/s target-only")
    if not measured:
        raise ConfigError(f"no runtime could open '{config.target}' here: {'; '.join(notes)}")
    if elapsed() > config.budget_s:
        raise ConfigError(
            f"--budget-s {config.budget_s:g} ran out while measuring the first runtime ({elapsed():.0f} s): "
            f"give at least {3 * elapsed():.0f} s"
        )

    by_speed = sorted(measured.values(), key=lambda f: -f.target_only_tokens_per_s)
    samples: list[DrafterSample] = []
    for spec in drafters:
        if samples and elapsed() > PHASE_ENDS[1] * config.budget_s:
            notes.append(f"drafter {spec} not sampled: the budget's share for drafters was spent")
            advance(f"{spec} skipped (budget)")
            continue
        sample = _sample_drafter(spec, by_speed, prompts, config, base, PHASE_ENDS[1] * config.budget_s - elapsed(), notes)
        if sample is not None:
            samples.append(sample)
        advance(f"{spec}: " + (f"{_acceptance(sample):.0%} accepted" if sample else "skipped"))

    candidates = _predict(measured, samples, config.max_k)
    chosen_set = _confirmation_set(candidates, measured, config.confirm, config.max_k)
    _confirm(chosen_set, measured, prompts, config, base, start)
    advance("confirmed")
    confirmed = [c for c in chosen_set if c.measured_tokens_per_s is not None]
    best = max(confirmed, key=lambda c: c.measured_tokens_per_s or 0.0)
    target_only = max((c for c in confirmed if c.drafter == "none"), key=lambda c: c.measured_tokens_per_s or 0.0)
    spec = best.drafter.removesuffix(TREE_SUFFIX)
    profile = Profile(
        target=config.target,
        drafter=spec,
        runtime=measured[best.runtime].runtime,
        generation=GenerationConfig(
            k=best.k, k_policy=best.k_policy, branches=TREE_BRANCHES if best.drafter.endswith(TREE_SUFFIX) else 1, sampling=sampling
        ),
        measured={
            "tokens_per_s": best.measured_tokens_per_s or 0.0,
            "target_only_tokens_per_s": target_only.measured_tokens_per_s or 0.0,
            "speedup_vs_target_only": (best.measured_tokens_per_s or 0.0) / (target_only.measured_tokens_per_s or 1.0),
            "sampled_prompts": len(prompts),
        },
    )
    results = {
        "config": {k: v for k, v in vars(config).items()},
        "machine": fingerprint(),
        "elapsed_s": elapsed(),
        "runtimes": {
            f.label: {
                "runtime": Profile(config.target, "none", f.runtime, base).to_dict()["runtime"],
                "load_s": f.load_s,
                "cost_ms": {n: 1000 * s for n, s in f.curve.seconds.items()},
                "overhead_ms": 1000 * f.overhead_s,
                "target_only_tokens_per_s": f.target_only_tokens_per_s,
            }
            for f in measured.values()
        },
        "drafters": {
            s.spec: {
                "sampled_on": s.runtime,
                "steps": len(s.steps),
                "acceptance": _acceptance(s),
                "accepted_per_step": sum(a for _, a in s.steps) / max(len(s.steps), 1),
                "draft_ms_per_step": 1000 * s.draft_s_per_step,
            }
            for s in samples
        },
        "candidates": [vars(c) | {"label": c.label} for c in candidates],
        "confirmed": [vars(c) | {"label": c.label} for c in chosen_set],
        "chosen": best.label,
        "profile": profile.to_dict(),
        "notes": notes,
    }
    return profile, results


def _measure_runtime(
    label: str, runtime: RuntimeConfig, config: TuneConfig, base: GenerationConfig, prompts: list[tuple[BenchPrompt, list[int]]]
) -> tuple[RuntimeFigures, list[tuple[BenchPrompt, list[int]]]]:
    """Open the target on ``runtime``, measure its cost curve and a target-only run; the prompts are encoded by the first runtime."""
    started = time.perf_counter()
    target = open_target(config.target, runtime)
    load_s = time.perf_counter() - started
    if not prompts:
        prompts = _usable_prompts(config, target)
    curve = CostCurve(forward_cost_curve(target.backend, repeats=3))
    generator = Generator(target, "none", base)
    generator.generate(prompts[0][1], max_new_tokens=4)  # warm-up
    rates, overheads = [], []
    for _, ids in prompts[:PROBE_PROMPTS]:
        s = generator.generate(ids).stats
        rates.append(s.tokens_per_s)
        if s.steps > 1:
            overheads.append(max(0.0, (s.wall_s - s.ttft_s) / (s.steps - 1) - curve(1)))
    overhead = statistics.median(overheads) if overheads else 0.0
    return RuntimeFigures(label, runtime, target, curve, statistics.median(rates), overhead, load_s), prompts


def _usable_prompts(config: TuneConfig, target: Target) -> list[tuple[BenchPrompt, list[int]]]:
    """The sampled prompts with their token ids; those empty or too long for the model's context are left out."""
    prompts = load_prompts(config.prompts)
    if target.tokenizer is None:
        raise ConfigError(f"target '{config.target}' has no tokenizer; tuning needs one to encode the prompts")
    usable = []
    for p in prompts:
        ids = target.tokenizer(p.prompt)["input_ids"]
        if ids and p.prompt.strip() and len(ids) + config.new_tokens + config.max_k < target.backend.max_context:
            usable.append((p, ids))
    if not usable:
        raise PromptError(
            f"prompts '{config.prompts}' have nothing usable: all {len(prompts)} are blank or longer than the model's context "
            f"({target.backend.max_context} tokens) less {config.new_tokens + config.max_k}; give prompts like the requests you will serve"
        )
    count = max(2, min(len(usable), int(config.budget_s / SECONDS_PER_PROMPT)))
    chosen = {p.id for p in sample_prompts([p for p, _ in usable], count)}
    return [(p, ids) for p, ids in usable if p.id in chosen]


def _sample_drafter(
    spec: str,
    by_speed: list[RuntimeFigures],
    prompts: list[tuple[BenchPrompt, list[int]]],
    config: TuneConfig,
    base: GenerationConfig,
    time_left: float,
    notes: list[str],
) -> DrafterSample | None:
    """Every step of chains (or trees) of max_k drafts on the sampled prompts, on the fastest runtime the drafter runs on."""
    sample = DrafterSample(spec, "")
    gen_config = replace(base, k=config.max_k, branches=TREE_BRANCHES if sample.tree else 1)
    reasons = []
    for figures in by_speed:
        try:
            generator = Generator(figures.target, build_drafter(sample.drafter, figures.target, figures.runtime), gen_config)
            generator.generate(prompts[0][1], max_new_tokens=4)  # warm-up
        except SpecDecError as exc:
            reasons.append(f"{figures.label}: {exc}")
            continue
        sample.runtime = figures.label
        started, draft_s = time.perf_counter(), 0.0
        for _, ids in prompts:
            if sample.steps and time.perf_counter() - started > time_left:
                notes.append(f"drafter {spec} sampled on {len(sample.steps)} steps only: the budget's share for drafters was spent")
                break
            s = generator.generate(ids).stats
            sample.steps += list(zip(s.proposed_per_step[1:], s.accepted_per_step[1:], strict=True))
            draft_s += s.draft_s
        sample.draft_s_per_step = draft_s / max(len(sample.steps), 1)
        return sample
    notes.append(f"drafter {spec} skipped: it runs on none of the measured runtimes ({'; '.join(reasons)})")
    return None


def _acceptance(sample: DrafterSample | None) -> float:
    if sample is None:
        return 0.0
    proposed = sum(p for p, _ in sample.steps)
    return sum(a for _, a in sample.steps) / proposed if proposed else 0.0


def _predict(measured: dict[str, RuntimeFigures], samples: list[DrafterSample], max_k: int) -> list[Candidate]:
    """Tokens per second of every (runtime, drafter, k), replaying the sampled steps on each runtime's curve; best first."""
    candidates = [Candidate(f.label, "none", 1, "fixed", 1 / (f.curve(1) + f.overhead_s)) for f in measured.values()]
    for f in measured.values():
        for s in samples:
            if not s.steps:
                continue
            for k in [max_k] if s.tree else range(1, max_k + 1):  # a tree's nodes cannot be cut to a prefix
                tokens = sum(1 + min(a, k) for _, a in s.steps)
                seconds = sum(f.curve(min(p, k) + 1) + f.overhead_s + s.draft_s_per_step * k / max_k for p, _ in s.steps)
                candidates.append(Candidate(f.label, s.spec, k, "fixed", tokens / seconds))
    return sorted(candidates, key=lambda c: -c.predicted_tokens_per_s)


def _confirmation_set(candidates: list[Candidate], measured: dict[str, RuntimeFigures], count: int, max_k: int) -> list[Candidate]:
    """The best predicted k of the ``count`` best (runtime, drafter) pairs, the cost-model policy for the best, and target-only."""
    chosen: list[Candidate] = []
    pairs: set[tuple[str, str]] = set()
    for c in candidates:
        if c.drafter != "none" and (c.runtime, c.drafter) not in pairs and len(pairs) < count:
            pairs.add((c.runtime, c.drafter))
            chosen.append(c)
    if chosen and not chosen[0].drafter.endswith(TREE_SUFFIX):
        top = chosen[0]
        chosen.append(Candidate(top.runtime, top.drafter, max_k, "cost-model", top.predicted_tokens_per_s))  # it aims at the best k
    runtimes = {c.runtime for c in chosen} | {max(measured.values(), key=lambda f: f.target_only_tokens_per_s).label}
    chosen += [c for c in candidates if c.drafter == "none" and c.runtime in runtimes]
    return chosen


def _confirm(
    chosen: list[Candidate],
    measured: dict[str, RuntimeFigures],
    prompts: list[tuple[BenchPrompt, list[int]]],
    config: TuneConfig,
    base: GenerationConfig,
    start: float,
) -> None:
    """Run every chosen candidate on the sampled prompts, taking turns per prompt; at least one prompt, then as the budget allows."""
    generators = []
    for c in chosen:
        f = measured[c.runtime]
        spec = c.drafter.removesuffix(TREE_SUFFIX)
        gen_config = replace(base, k=c.k, k_policy=c.k_policy, branches=TREE_BRANCHES if spec != c.drafter else 1)
        generator = Generator(f.target, build_drafter(spec, f.target, f.runtime), gen_config)
        generator.generate(prompts[0][1], max_new_tokens=4)  # warm-up
        generators.append(generator)
    tokens = [dict[str, int]() for _ in chosen]
    seconds = [dict[str, float]() for _ in chosen]
    round_s = 0.0
    for index, (prompt, ids) in enumerate(prompts):
        if index and time.perf_counter() - start + round_s > config.budget_s:
            break
        round_start = time.perf_counter()
        order = list(range(len(chosen)))
        shift = index % len(order)
        for i in order[shift:] + order[:shift]:  # rotated, so that drift falls on all alike
            result = generators[i].generate(ids)
            tokens[i][prompt.category] = tokens[i].get(prompt.category, 0) + len(result.token_ids)
            seconds[i][prompt.category] = seconds[i].get(prompt.category, 0.0) + result.stats.wall_s
        round_s = time.perf_counter() - round_start
    for c, t, s in zip(chosen, tokens, seconds, strict=True):
        c.measured_tokens_per_s = sum(t.values()) / sum(s.values())
        c.measured_by_category = {category: t[category] / s[category] for category in t}
