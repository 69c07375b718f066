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
from dataclasses import asdict, dataclass, field, replace

from specdec.bench.methods import PEER_PREFIXES, check_method
from specdec.bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts, round_robin
from specdec.config import PRESETS, TREE_BRANCHES, TREE_SUFFIX, GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.drafters import LEARNING_SPECS, build_drafter
from specdec.engine import Generator
from specdec.errors import ConfigError, PromptError, SpecDecError
from specdec.machine import fingerprint
from specdec.models import DEFAULT_TARGET, Target, open_target, resolve
from specdec.models.cpu_kernels import variant as kernel_variant
from specdec.models.cpu_kernels import vnni_available
from specdec.models.llamacpp import llama_cpp_installed
from specdec.models.registry import bundled_draft
from specdec.profile import Profile, runtime_dict
from specdec.scheduling import CostCurve

MIN_BUDGET_S = 30.0  # below this not even one runtime's curve and a short run fit
PHASE_ENDS = (0.3, 0.6)  # shares of the budget by which runtime measurement, then drafter sampling, stop starting work
SECONDS_PER_PROMPT = 50.0  # the budget buys one sampled prompt per this many seconds (at least 2, at most the set)
PROBE_PROMPTS = 2  # prompts of each runtime's target-only run
MARGIN = 1.03  # speculation must beat the fastest target-only measured by this much to be chosen (short runs are noisy)
# A runtime that fails to open is skipped, with the reason.
OPEN_ERRORS = (SpecDecError, RuntimeError, OSError, MemoryError)


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
                f"--budget-s {self.budget_s:g} is too small to measure anything: "
                f"one runtime's cost curve and a short run take about {MIN_BUDGET_S:.0f} s; "
                f"give at least {MIN_BUDGET_S:.0f} (the default, 600, measures every runtime and drafter)"
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

    @property
    def calibration(self) -> float:
        """Measured target-only tokens/s over the curve's own prediction: what a step costs beyond the curve and the
        overhead (the prompt's prefill, a cached curve from a busier or quieter day), applied to every prediction."""
        return self.target_only_tokens_per_s * (self.curve(1) + self.overhead_s)


@dataclass
class DrafterSample:
    spec: str  # as given: "prompt-lookup", "prompt-lookup+tree"
    runs_on: list[str] = field(default_factory=list)  # every measured runtime it can draft for, fastest first
    steps: list[tuple[int, int, float]] = field(default_factory=list)  # (proposed, accepted, draft seconds) per step

    @property
    def runtime(self) -> str:
        """The runtime it was sampled on: the fastest it runs on."""
        return self.runs_on[0]

    @property
    def drafter(self) -> str:
        return self.spec.removesuffix(TREE_SUFFIX)

    @property
    def tree(self) -> bool:
        return self.spec.endswith(TREE_SUFFIX)

    @property
    def acceptance(self) -> float:
        proposed = sum(p for p, _, _ in self.steps)
        return sum(a for _, a, _ in self.steps) / proposed if proposed else 0.0


@dataclass
class Candidate:
    runtime: str
    drafter: str  # a spec, "none" for target-only
    k: int  # 1 for target-only (a GenerationConfig's least; nothing is drafted)
    k_policy: str
    predicted_tokens_per_s: float  # for the cost-model policy: the best fixed k's prediction (the policy aims at it)
    measured_tokens_per_s: float | None = None
    measured_by_category: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        depth = "" if self.drafter == "none" else f" {self.k_policy} k={self.k}"
        return f"{self.runtime} / {self.drafter}{depth}"


def runtime_candidates(target: str) -> dict[str, RuntimeConfig]:
    """Every runtime and precision plan worth measuring for ``target`` here, fastest measured first."""
    import torch

    found: dict[str, RuntimeConfig] = {}
    cuda, vnni = torch.cuda.is_available(), vnni_available()
    if not cuda and kernel_variant() is not None:
        found["native"] = RuntimeConfig(backend="native")
    if llama_cpp_installed() and resolve(target).kind in ("alias", "gguf"):
        found["llama.cpp"] = RuntimeConfig(backend="llama.cpp")
    if cuda:
        found["transformers/bf16"] = RuntimeConfig(precision=PRESETS["bf16"])
    elif vnni:
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
    """The runtimes and drafters the search will try (checked before any model loads), and its units of progress."""
    available = runtime_candidates(config.target)
    if config.runtimes:
        unknown = [r for r in config.runtimes if r not in available]
        if unknown:
            raise ConfigError(
                f"runtime(s) {', '.join(unknown)} cannot run '{config.target}' here: "
                f"choose among {', '.join(available)}"
            )
        available = {r: available[r] for r in config.runtimes}
    # Target-only always runs.
    drafters = [d for d in dict.fromkeys(config.drafters or drafter_candidates(config.target)) if d != "none"]
    for spec in drafters:
        drafter = spec.removesuffix(TREE_SUFFIX)
        if (
            drafter.partition(":")[0] == "oracle"
            or drafter.startswith(PEER_PREFIXES)
            or check_method(spec, config.target) is not None
        ):
            raise ConfigError(f"'{spec}' is not a drafter to tune: use a --draft spec, or DRAFTER{TREE_SUFFIX}")
        if drafter in LEARNING_SPECS:
            raise ConfigError(
                f"'{spec}' learns from the answers it has drafted, and tune replays the same prompts: "
                "compare it with `specdec bench --methods prompt-lookup,suffix`"
            )
    return available, drafters, len(available) + len(drafters) + 1


def tune(config: TuneConfig, advance: Callable[[str], None] = lambda _: None) -> tuple[Profile, dict]:
    """Search; return the profile of the fastest measured configuration and every figure behind the choice."""
    start = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - start

    runtimes, drafters, _ = plan(config)
    texts = load_prompts(config.prompts)  # a missing or empty file fails here, before any model loads
    sampling = SamplingConfig(config.temperature)
    base = GenerationConfig(
        k=1, k_policy="fixed", max_new_tokens=config.new_tokens, sampling=sampling, seed=config.seed
    )
    notes: list[str] = []

    measured: dict[str, RuntimeFigures] = {}
    prompts: list[tuple[BenchPrompt, list[int]]] = []
    for label, runtime in runtimes.items():
        if measured and elapsed() > PHASE_ENDS[0] * config.budget_s:
            notes.append(f"runtime {label} not measured: the budget's share for runtimes was spent")
            advance(f"{label} skipped (budget)")
            continue
        opened = time.perf_counter()
        try:
            target = open_target(config.target, runtime)
        except OPEN_ERRORS as exc:
            notes.append(f"runtime {label} skipped: {exc}")
            advance(f"{label} skipped")
            continue
        load_s = time.perf_counter() - opened
        try:
            prompts = _fitting(prompts or _encode(config, texts, target), target, config)
        except PromptError as exc:
            if not measured:
                raise  # the prompts fit no runtime
            notes.append(f"runtime {label} skipped: {exc}")  # its context is shorter than an earlier runtime's
            advance(f"{label} skipped")
            continue
        measured[label] = _measure_runtime(label, runtime, target, load_s, prompts, base)
        advance(f"{label}: {measured[label].target_only_tokens_per_s:.1f} tok/s target-only")
        if len(measured) == 1 and elapsed() > config.budget_s:
            raise ConfigError(
                f"--budget-s {config.budget_s:g} ran out while measuring the first runtime ({elapsed():.0f} s): "
                f"give at least {3 * elapsed():.0f} s"
            )
    if not measured:
        raise ConfigError(f"no runtime could open '{config.target}' here: {'; '.join(notes)}")

    by_speed = sorted(measured.values(), key=lambda f: -f.target_only_tokens_per_s)
    samples: list[DrafterSample] = []
    for spec in drafters:
        if elapsed() > PHASE_ENDS[1] * config.budget_s:
            notes.append(f"drafter {spec} not sampled: the budget's share for drafters was spent")
            advance(f"{spec} skipped (budget)")
            continue
        sample = _sample_drafter(spec, by_speed, prompts, config, base, start + PHASE_ENDS[1] * config.budget_s, notes)
        if sample is not None:
            samples.append(sample)
        advance(f"{spec}: " + (f"{sample.acceptance:.0%} accepted" if sample else "skipped"))

    candidates = _predict(measured, samples, config.max_k)
    chosen_set = _confirmation_set(candidates, measured, config.confirm, config.max_k)
    for label in set(measured) - {c.runtime for c in chosen_set}:
        measured[label].target = None  # type: ignore[assignment]  # free the models no confirmation needs
    _confirm(chosen_set, measured, prompts, config, base, start, notes)
    advance("confirmed")
    confirmed = [c for c in chosen_set if c.measured_tokens_per_s is not None]
    target_only = max((c for c in confirmed if c.drafter == "none"), key=lambda c: c.measured_tokens_per_s or 0.0)
    fastest = max(confirmed, key=lambda c: c.measured_tokens_per_s or 0.0)
    best = (
        fastest
        if (fastest.measured_tokens_per_s or 0.0) >= MARGIN * (target_only.measured_tokens_per_s or 0.0)
        else target_only
    )
    profile = Profile(
        target=config.target,
        drafter=best.drafter.removesuffix(TREE_SUFFIX),
        runtime=measured[best.runtime].runtime,
        generation=GenerationConfig(
            k=best.k,
            k_policy=best.k_policy,
            branches=TREE_BRANCHES if best.drafter.endswith(TREE_SUFFIX) else 1,
            sampling=sampling,
        ),
        measured={
            "tokens_per_s": best.measured_tokens_per_s or 0.0,
            "target_only_tokens_per_s": target_only.measured_tokens_per_s or 0.0,
            "speedup_vs_target_only": (best.measured_tokens_per_s or 0.0) / (target_only.measured_tokens_per_s or 1.0),
            "sampled_prompts": len(prompts),
        },
    )
    results = {
        "config": asdict(config),
        "machine": fingerprint(),
        "elapsed_s": elapsed(),
        "runtimes": {
            f.label: {
                "runtime": runtime_dict(f.runtime),
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
                "runs_on": s.runs_on,
                "steps": len(s.steps),
                "acceptance": s.acceptance,
                "accepted_per_step": sum(a for _, a, _ in s.steps) / max(len(s.steps), 1),
                "draft_ms_per_step": 1000 * sum(d for _, _, d in s.steps) / max(len(s.steps), 1),
            }
            for s in samples
        },
        "categories": sorted({p.category for p, _ in prompts}),
        "candidates": [vars(c) | {"label": c.label} for c in candidates],
        "confirmed": [vars(c) | {"label": c.label} for c in chosen_set],
        "chosen": best.label,
        "profile": profile.to_dict(),
        "notes": notes,
    }
    return profile, results


def _encode(config: TuneConfig, texts: list[BenchPrompt], target: Target) -> list[tuple[BenchPrompt, list[int]]]:
    """A sample of the prompts, taken in turn from each category, with their token ids; blank ones are left out."""
    if target.tokenizer is None:
        raise ConfigError(f"target '{config.target}' has no tokenizer; tuning needs one to encode the prompts")
    usable = [(p, target.tokenizer(p.prompt)["input_ids"]) for p in round_robin(texts) if p.prompt.strip()]
    count = max(2, int(config.budget_s / SECONDS_PER_PROMPT))
    return [(p, ids) for p, ids in usable if ids][:count] or _nothing_usable(config, texts, "blank")


def _fitting(
    prompts: list[tuple[BenchPrompt, list[int]]], target: Target, config: TuneConfig
) -> list[tuple[BenchPrompt, list[int]]]:
    """The prompts that leave room for the new tokens and a draft in this runtime's context."""
    room = target.backend.max_context - config.new_tokens - config.max_k
    return [(p, ids) for p, ids in prompts if len(ids) < room] or _nothing_usable(
        config, [p for p, _ in prompts], f"longer than {room} tokens"
    )


def _nothing_usable(config: TuneConfig, prompts: list[BenchPrompt], why: str) -> list:
    raise PromptError(
        f"prompts '{config.prompts}' have nothing usable: all {len(prompts)} sampled are {why} "
        f"(the model's context less {config.new_tokens + config.max_k} tokens for the output and a draft); "
        "give prompts like the requests you will serve"
    )


def _measure_runtime(
    label: str,
    runtime: RuntimeConfig,
    target: Target,
    load_s: float,
    prompts: list[tuple[BenchPrompt, list[int]]],
    base: GenerationConfig,
) -> RuntimeFigures:
    """The runtime's cost curve (measured once per machine and cached, as the cost-model policy reads it) and a short
    target-only run."""
    generator = Generator(target, "none", base)
    curve = generator.costs()
    generator.generate(prompts[0][1], max_new_tokens=4)  # warm-up
    rates, overheads = [], []
    for _, ids in prompts[:PROBE_PROMPTS]:
        s = generator.generate(ids).stats
        rates.append(s.tokens_per_s)
        if s.steps > 1:
            overheads.append(max(0.0, (s.wall_s - s.ttft_s) / (s.steps - 1) - curve(1)))
    overhead = statistics.median(overheads) if overheads else 0.0
    return RuntimeFigures(label, runtime, target, curve, statistics.median(rates), overhead, load_s)


def _sample_drafter(
    spec: str,
    by_speed: list[RuntimeFigures],
    prompts: list[tuple[BenchPrompt, list[int]]],
    config: TuneConfig,
    base: GenerationConfig,
    deadline: float,
    notes: list[str],
) -> DrafterSample | None:
    """Every step of chains (or trees) of max_k drafts on the sampled prompts, on the drafter's fastest runtime.

    The first step of each prompt (it also reads the prompt) and those whose drafts the length limit cut are left out.
    The drafter is also built on every other runtime: the prediction covers only those it runs on.
    """
    sample = DrafterSample(spec)
    gen_config = replace(base, k=config.max_k, branches=TREE_BRANCHES if sample.tree else 1)
    generator: Generator | None = None  # on the fastest runtime it runs on; the others are only checked
    reasons = []
    for figures in by_speed:
        try:
            built = Generator(
                figures.target, build_drafter(sample.drafter, figures.target, figures.runtime), gen_config
            )
            built.completion(prompts[0][1])  # refuses what this backend cannot verify (trees on llama.cpp)
        except OPEN_ERRORS as exc:
            reasons.append(f"{figures.label}: {exc}")
            continue
        sample.runs_on.append(figures.label)
        generator = generator or built
    if generator is None:
        notes.append(f"drafter {spec} skipped: it runs on none of the measured runtimes ({'; '.join(reasons)})")
        return None
    generator.generate(prompts[0][1], max_new_tokens=4)  # warm-up
    for _, ids in prompts:
        if sample.steps and time.perf_counter() > deadline:
            notes.append(
                f"drafter {spec} sampled on {len(sample.steps)} steps only: the budget's share for drafters was spent"
            )
            break
        s = generator.generate(ids).stats
        produced = 0
        for step, (p, a) in enumerate(zip(s.proposed_per_step, s.accepted_per_step, strict=True)):
            room = config.new_tokens - produced - 1  # drafts this step could take before the length limit
            if step and room >= config.max_k:  # every step drafts (no guards), so draft_s_per_step lines up with them
                sample.steps.append((p, a, s.draft_s_per_step[step]))
            produced += a + 1
    return sample


def _predict(measured: dict[str, RuntimeFigures], samples: list[DrafterSample], max_k: int) -> list[Candidate]:
    """Tokens per second of every (runtime, drafter, k) the drafter runs on, replaying its sampled steps on the
    runtime's curve; best first.

    A step that proposed p tokens and had a accepted, replayed at k, proposes min(p, k) and keeps min(a, k); it costs a
    forward over min(p, k) + 1 tokens, the runtime's per-step overhead and its drafting time scaled by k / max_k (a
    drafting cost proportional to k: a drafter's fixed cost per step is underestimated at small k). Each runtime's rates
    are scaled by its calibration, so that its target-only prediction is its measured rate.
    """
    candidates = [Candidate(f.label, "none", 1, "fixed", f.target_only_tokens_per_s) for f in measured.values()]
    for s in samples:
        if not s.steps:
            continue
        for label in s.runs_on:
            f = measured[label]
            for k in [max_k] if s.tree else range(1, max_k + 1):  # a tree's nodes cannot be cut to a prefix
                tokens = sum(1 + min(a, k) for _, a, _ in s.steps)
                seconds = sum(f.curve(min(p, k) + 1) + f.overhead_s + d * k / max_k for p, _, d in s.steps)
                candidates.append(Candidate(label, s.spec, k, "fixed", f.calibration * tokens / seconds))
    return sorted(candidates, key=lambda c: -c.predicted_tokens_per_s)


def _confirmation_set(
    candidates: list[Candidate], measured: dict[str, RuntimeFigures], count: int, max_k: int
) -> list[Candidate]:
    """The best predicted k of the ``count`` best (runtime, drafter) pairs, the cost-model policy for the best, and
    target-only on each of their runtimes and on the fastest."""
    chosen: list[Candidate] = []
    pairs: set[tuple[str, str]] = set()
    for c in candidates:
        if c.drafter != "none" and (c.runtime, c.drafter) not in pairs and len(pairs) < count:
            pairs.add((c.runtime, c.drafter))
            chosen.append(c)
    if chosen and not chosen[0].drafter.endswith(TREE_SUFFIX):
        top = chosen[0]
        chosen.append(Candidate(top.runtime, top.drafter, max_k, "cost-model", top.predicted_tokens_per_s))
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
    notes: list[str],
) -> None:
    """Run every chosen candidate on the sampled prompts, taking turns per prompt;
    one round, then more while the budget lasts."""
    generators: dict[int, Generator] = {}
    for i, c in enumerate(chosen):
        f = measured[c.runtime]
        spec = c.drafter.removesuffix(TREE_SUFFIX)
        gen_config = replace(base, k=c.k, k_policy=c.k_policy, branches=TREE_BRANCHES if spec != c.drafter else 1)
        try:
            generators[i] = Generator(f.target, build_drafter(spec, f.target, f.runtime), gen_config)
            generators[i].generate(prompts[0][1], max_new_tokens=4)  # warm-up
        except OPEN_ERRORS as exc:
            notes.append(f"{c.label} not confirmed: {exc}")
    tokens: dict[int, dict[str, int]] = {i: {} for i in generators}
    seconds: dict[int, dict[str, float]] = {i: {} for i in generators}
    round_s = 0.0
    for index, (prompt, ids) in enumerate(prompts):
        if index and time.perf_counter() - start + round_s > config.budget_s:
            notes.append(f"confirmation ran {index} of {len(prompts)} sampled prompts: the budget was spent")
            break
        round_start = time.perf_counter()
        order = list(generators)
        shift = index % len(order)
        for i in order[shift:] + order[:shift]:  # rotated, so that drift falls on all alike
            result = generators[i].generate(ids)
            tokens[i][prompt.category] = tokens[i].get(prompt.category, 0) + len(result.token_ids)
            seconds[i][prompt.category] = seconds[i].get(prompt.category, 0.0) + result.stats.wall_s
        round_s = time.perf_counter() - round_start
    for i in generators:
        if sum(tokens[i].values()):
            chosen[i].measured_tokens_per_s = sum(tokens[i].values()) / sum(seconds[i].values())
            chosen[i].measured_by_category = {
                category: tokens[i][category] / seconds[i][category] for category in tokens[i]
            }
