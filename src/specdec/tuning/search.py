"""`specdec tune`: the fastest exact configuration for this machine, target and prompts, found within a time budget.

Whether speculation pays depends on three things no default can know: the runtime's price of verifying n tokens
on this machine, the drafter's acceptance on the user's text, and the drafter's own cost. The search measures
each, predicts every configuration from them, and lets a real run on prompts it did not use decide:

1. runtimes: the target opens on each runtime that runs here; on the first, one target-only prompt says whether the
   budget can buy the least search at all (else a one-line refusal, before the budget is spent); its forward cost curve
   is measured, and a short target-only run gives its tokens/s, the engine's per-step cost outside the forward and a
   prompt's time, which sizes the sample to the budget; target-only's rate on the search part (below) rescales every
   runtime's;
2. split: the prompts are dealt per category into a search part and a held-out part, each covering every category;
   a budget or a prompt file too small for that is refused in one line, before anything is written;
3. drafters: each drafts chains of max_k tokens on the search part, on the fastest runtime it runs on, keeping
   every step's proposed and accepted tokens; its drafting time is measured at k = max_k and at k = 1;
4. prediction: those steps are replayed on every runtime's curve for every k up to max_k (a step that accepted
   a tokens of p keeps min(a, k) of min(p, k)), with the drafting cost interpolated between the measured k;
5. confirmation, on the held-out part: the best predicted configurations, the cost-model policy for the best, each
   of their runtimes' target-only and the library's default (the ``auto`` drafter, cost-model k) run in turns (those
   of slower runtimes are dropped where the budget left cannot buy the held-out prompts needed of them all). A
   contender whose drafting time missed its model by more than OFF_BY has that cost re-measured from the run, and
   what then predicts above the fastest measured is confirmed too. The profile is the contender that beats the
   default prompt by prompt (geometric mean of the ratios) by more than the margin and the run's noise, else the
   default.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from specdec.bench.methods import PEER_PREFIXES, check_method
from specdec.bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts, round_robin
from specdec.bench.runner import WARM_UP
from specdec.config import PRESETS, TREE_BRANCHES, TREE_SUFFIX, GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.drafters import Drafter, build_drafter
from specdec.engine import Generator
from specdec.engine.stats import DecodeStats
from specdec.errors import ConfigError, PromptError, SpecDecError
from specdec.machine import fingerprint
from specdec.models import DEFAULT_TARGET, Target, open_target, resolve
from specdec.models.llamacpp import llama_cpp_installed
from specdec.models.native.kernel_build import variant as kernel_variant
from specdec.models.native.kernel_build import vnni_available
from specdec.models.registry import bundled_draft
from specdec.profile import Profile, runtime_dict
from specdec.scheduling import CostCurve

MIN_BUDGET_S = 30.0  # below this not even one runtime's curve and a short run fit
PHASE_ENDS = (0.3, 0.6)  # shares of the budget by which runtime measurement, then drafter sampling, stop starting work
PROBE_PROMPTS = 2  # prompts of each runtime's target-only run
MIN_HELD_OUT = 4  # the fewest held-out prompts a choice is confirmed on (and at least one per category)
DRAFTING_SLOWDOWN = 1.5  # a sampled prompt's time over target-only's, for sizing the search part
MARGIN = 1.03  # a contender must beat the default by this much, or by the run's noise if larger, to be chosen
MAX_ROUNDS = 4  # confirmation rounds over the held-out prompts, budget permitting
OFF_BY = 0.15  # a confirmed contender this far from its prediction has its drafting cost re-measured
DEFAULT_DRAFTER = "auto"  # the library's default configuration: this drafter with GenerationConfig's k and policy
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


Encoded = list[tuple[BenchPrompt, list[int]]]


@dataclass
class RuntimeFigures:
    label: str
    runtime: RuntimeConfig
    target: Target
    curve: CostCurve
    target_only_tokens_per_s: float
    overhead_s: float  # per step, outside the forward (the engine, sampling, bookkeeping)
    load_s: float
    prompt_s: float = 0.0  # a target-only prompt's time, prefill included
    first_token_s: float = 0.0  # a prompt's prefill and first token; 0: rates are decoding rates alone
    decode_tokens_per_s: float = 0.0  # target-only after the first token (0: target_only_tokens_per_s)
    tokens_per_prompt: float = 0.0  # new tokens a prompt gets (fewer than asked where it ends)

    def __post_init__(self) -> None:
        self.decode_tokens_per_s = self.decode_tokens_per_s or self.target_only_tokens_per_s

    @property
    def calibration(self) -> float:
        """Measured target-only decoding tokens/s over the curve's own prediction: what a step costs beyond the curve
        and the overhead (a cached curve from a busier or quieter day), applied to every prediction."""
        return self.decode_tokens_per_s * (self.curve(1) + self.overhead_s)

    def prompt_rate(self, decode_tokens_per_s: float) -> float:
        """Tokens/s over a whole prompt, its first token's time included, at a decoding rate."""
        if not self.first_token_s or self.tokens_per_prompt <= 1:
            return decode_tokens_per_s
        n = self.tokens_per_prompt
        return n / (self.first_token_s + (n - 1) / decode_tokens_per_s)


@dataclass
class DrafterSample:
    spec: str  # as given: "prompt-lookup", "prompt-lookup+tree"
    runs_on: list[str] = field(default_factory=list)  # every measured runtime it can draft for, fastest first
    steps: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted) per step at max_k
    draft_s_by_k: dict[int, float] = field(default_factory=dict)  # drafting seconds per step, by k, as modelled
    sampled_draft_s_by_k: dict[int, float] = field(default_factory=dict)  # as sampled (before any re-measurement)

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
        proposed = sum(p for p, _ in self.steps)
        return sum(a for _, a in self.steps) / proposed if proposed else 0.0

    def draft_s(self, k: int) -> float:
        """Drafting seconds per step at ``k``: linear between the nearest measured k, flat beyond them."""
        known = sorted(self.draft_s_by_k.items())
        if not known:
            return 0.0
        below = [(n, s) for n, s in known if n <= k] or known[:1]
        above = [(n, s) for n, s in known if n >= k] or known[-1:]
        (k0, s0), (k1, s1) = below[-1], above[0]
        return s0 if k1 == k0 else s0 + (s1 - s0) * (k - k0) / (k1 - k0)


@dataclass
class Candidate:
    runtime: str
    drafter: str  # a spec; "none" for target-only, DEFAULT_DRAFTER for the library's default
    k: int  # 1 for target-only (a GenerationConfig's least; nothing is drafted)
    k_policy: str
    # for the cost-model policy: the best fixed k's prediction (the policy aims at it); None for the default
    predicted_tokens_per_s: float | None
    measured_tokens_per_s: float | None = None
    measured_by_category: dict[str, float] = field(default_factory=dict)
    measured_by_prompt: list[float | None] = field(default_factory=list)  # tokens/s on each held-out prompt
    measured_draft_ms_per_step: float | None = None
    drafts_with: str | None = None  # what the default's ``auto`` resolved to
    second_round: bool = False  # confirmed after re-measuring a drafter's cost

    @property
    def label(self) -> str:
        if self.drafter == "none":
            return f"{self.runtime} / none"
        name = f"{DEFAULT_DRAFTER} ({self.drafts_with})" if self.drafts_with else self.drafter
        return f"{self.runtime} / {name} {self.k_policy} k={self.k}"

    @property
    def off_by(self) -> float | None:
        """Measured over predicted, less one; None where either is missing."""
        if self.measured_tokens_per_s is None or not self.predicted_tokens_per_s:
            return None
        return self.measured_tokens_per_s / self.predicted_tokens_per_s - 1


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
    """prompt-lookup, suffix, and the drafts shipped for ``target``."""
    found = ["prompt-lookup", "suffix"]
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
    # Target-only and the default always run.
    drafters = [
        d for d in dict.fromkeys(config.drafters or drafter_candidates(config.target)) if d not in ("none", "auto")
    ]
    for spec in drafters:
        drafter = spec.removesuffix(TREE_SUFFIX)
        if (
            drafter.partition(":")[0] == "oracle"
            or drafter.startswith(PEER_PREFIXES)
            or check_method(spec, config.target) is not None
        ):
            raise ConfigError(f"'{spec}' is not a drafter to tune: use a --draft spec, or DRAFTER{TREE_SUFFIX}")
    return available, drafters, len(available) + len(drafters) + 1


def tune(config: TuneConfig, advance: Callable[[str], None] = lambda _: None) -> tuple[Profile, dict]:
    """Search; return the profile of the fastest configuration measured on held-out prompts (the default where
    nothing beats it beyond the noise) and every figure behind the choice."""
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
    pool: Encoded = []
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
            pool = _fitting(pool or _encode(config, texts, target), target, config)
        except PromptError as exc:
            if not measured:
                raise  # the prompts fit no runtime
            notes.append(f"runtime {label} skipped: {exc}")  # its context is shorter than an earlier runtime's
            advance(f"{label} skipped")
            continue
        first = None
        if not measured:  # one prompt says at once whether the budget can buy the least search, before it is spent
            first = _first_prompt(target, pool, base)
            _check_budget(config, label, pool, first.wall_s, elapsed(), len(drafters))
        measured[label] = _measure_runtime(label, runtime, target, load_s, pool, base, first)
        advance(f"{label}: {measured[label].target_only_tokens_per_s:.1f} tok/s target-only")
        if len(measured) == 1 and elapsed() > config.budget_s:
            raise ConfigError(
                f"--budget-s {config.budget_s:g} ran out while measuring the first runtime ({elapsed():.0f} s): "
                f"give at least {3 * elapsed():.0f} s"
            )
    if not measured:
        raise ConfigError(f"no runtime could open '{config.target}' here: {'; '.join(notes)}")

    by_speed = sorted(measured.values(), key=lambda f: -f.target_only_tokens_per_s)
    search, held_out = _split(pool, config, by_speed[0].prompt_s, len(drafters), len(measured), elapsed())
    _calibrate_on(search, by_speed, base)
    samples: list[DrafterSample] = []
    for spec in drafters:
        if elapsed() > PHASE_ENDS[1] * config.budget_s:
            notes.append(f"drafter {spec} not sampled: the budget's share for drafters was spent")
            advance(f"{spec} skipped (budget)")
            continue
        sample = _sample_drafter(spec, by_speed, search, config, base, start + PHASE_ENDS[1] * config.budget_s, notes)
        if sample is not None:
            samples.append(sample)
        advance(f"{spec}: " + (f"{sample.acceptance:.0%} accepted" if sample else "skipped"))

    candidates = _predict(measured, samples, config.max_k)
    chosen_set = _confirmation_set(candidates, measured, config.confirm, config.max_k)
    chosen_set = _affordable(chosen_set, measured, _needed(held_out), config.budget_s - elapsed(), notes)
    for label in set(measured) - {c.runtime for c in chosen_set}:
        measured[label].target = None  # type: ignore[assignment]  # free the models no confirmation needs
    deadline = start + config.budget_s
    confirmation = Confirmation(measured, held_out, base, notes)
    confirmation.add(chosen_set)
    per_contender_s = confirmation.run(deadline) / len(chosen_set)  # a round's time per contender
    confirmation.record()
    _enough_confirmed(chosen_set, held_out, config, elapsed())
    candidates, second = _remeasure(chosen_set, samples, measured, config, notes)
    if second and elapsed() + per_contender_s * len(second) > config.budget_s:
        notes.append("not confirmed for want of budget after re-measuring: " + ", ".join(c.label for c in second))
    elif second:
        confirmation.add(second)
        confirmation.run(deadline, only=second)
        chosen_set += second
    rounds = 1
    while rounds < MAX_ROUNDS and elapsed() + per_contender_s * len(chosen_set) < config.budget_s:
        confirmation.run(deadline)  # more rounds while the budget lasts: less timing noise
        rounds += 1
    confirmation.record()
    advance("confirmed")
    confirmed = [c for c in chosen_set if c.measured_tokens_per_s is not None]
    best, reference, threshold = _choose(confirmed, _needed(held_out))
    target_only = max((c for c in confirmed if c.drafter == "none"), key=_rate)
    profile = Profile(
        target=config.target,
        drafter=best.drafts_with or best.drafter.removesuffix(TREE_SUFFIX),
        runtime=measured[best.runtime].runtime,
        generation=GenerationConfig(
            k=best.k,
            k_policy=best.k_policy,
            branches=TREE_BRANCHES if best.drafter.endswith(TREE_SUFFIX) else 1,
            sampling=sampling,
        ),
        measured={
            "tokens_per_s": _rate(best),
            "target_only_tokens_per_s": _rate(target_only),
            "speedup_vs_target_only": _rate(best) / (_rate(target_only) or 1.0),
            "default_tokens_per_s": _rate(reference),
            "speedup_vs_default": _rate(best) / (_rate(reference) or 1.0),
            "sampled_prompts": len(search),
            "held_out_prompts": len(held_out),
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
                "prompt_s": f.prompt_s,
            }
            for f in measured.values()
        },
        "prompts": {
            "search": [p.id for p, _ in search],
            "held_out": [p.id for p, _ in held_out],
        },
        "drafters": {
            s.spec: {
                "sampled_on": s.runtime,
                "runs_on": s.runs_on,
                "steps": len(s.steps),
                "acceptance": s.acceptance,
                "accepted_per_step": sum(a for _, a in s.steps) / max(len(s.steps), 1),
                "sampled_draft_ms_by_k": {k: 1000 * t for k, t in sorted(s.sampled_draft_s_by_k.items())},
                "draft_ms_by_k": {k: 1000 * t for k, t in sorted(s.draft_s_by_k.items())},
            }
            for s in samples
        },
        "categories": sorted({p.category for p, _ in held_out}),
        "candidates": [_row(c) for c in candidates],
        "confirmed": [_row(c) for c in chosen_set],
        "default": reference.label,
        "threshold": threshold,
        "chosen": best.label,
        "profile": profile.to_dict(),
        "notes": notes,
    }
    return profile, results


def _rate(c: Candidate) -> float:
    return c.measured_tokens_per_s or 0.0


def _row(c: Candidate) -> dict:
    return vars(c) | {"label": c.label, "off_by": c.off_by}


def _encode(config: TuneConfig, texts: list[BenchPrompt], target: Target) -> Encoded:
    """Every prompt, taken in turn from each category, with its token ids; blank ones are left out."""
    if target.tokenizer is None:
        raise ConfigError(f"target '{config.target}' has no tokenizer; tuning needs one to encode the prompts")
    usable = [(p, target.tokenizer(p.prompt)["input_ids"]) for p in round_robin(texts) if p.prompt.strip()]
    return [(p, ids) for p, ids in usable if ids] or _nothing_usable(config, texts, "blank")


def _fitting(prompts: Encoded, target: Target, config: TuneConfig) -> Encoded:
    """The prompts that leave room for the new tokens and a draft in this runtime's context."""
    room = target.backend.max_context - config.new_tokens - config.max_k
    return [(p, ids) for p, ids in prompts if len(ids) < room] or _nothing_usable(
        config, [p for p, _ in prompts], f"longer than {room} tokens"
    )


def _nothing_usable(config: TuneConfig, prompts: list[BenchPrompt], why: str) -> list:
    raise PromptError(
        f"prompts '{config.prompts}' have nothing usable: all {len(prompts)} are {why} "
        f"(the model's context less {config.new_tokens + config.max_k} tokens for the output and a draft); "
        "give prompts like the requests you will serve"
    )


def _deal(pool: Encoded, config: TuneConfig) -> tuple[Encoded, Encoded, int, int]:
    """(search part, held-out part, categories, held-out prompts needed): each category's prompts dealt alternately
    (held-out first), each part in turns of the categories. Refuses, in one line, a prompt file that cannot give both
    parts every category and the held-out part MIN_HELD_OUT prompts."""
    by_category: dict[str, list[tuple[BenchPrompt, list[int]]]] = {}
    for item in pool:
        by_category.setdefault(item[0].category, []).append(item)
    held_out = _in_turns([item for items in by_category.values() for item in items[0::2]])
    search = _in_turns([item for items in by_category.values() for item in items[1::2]])
    categories = len(by_category)
    needed = max(MIN_HELD_OUT, categories)
    if len(held_out) < needed or len({p.category for p, _ in search}) < categories:
        raise PromptError(
            f"prompts '{config.prompts}' give {len(pool)} usable prompts in {categories} categories: tune samples "
            f"drafters on one half and confirms on the other, which needs at least {needed} held-out prompts and "
            f"two of every category; give at least {max(2 * needed, 2 * categories)} prompts like the requests you "
            "will serve"
        )
    return search, held_out, categories, needed


def _contenders(config: TuneConfig, drafters: int, runtimes: int) -> int:
    """How many contenders the confirmation runs at most: the best pairs, the cost-model policy, and target-only and
    the default on each of their runtimes."""
    pairs = min(config.confirm, max(drafters, 1) * runtimes)
    return pairs + 1 + 2 * min(pairs + 1, runtimes)


def _least_budget_s(
    prompt_s: float, spent_s: float, categories: int, needed: int, drafters: int, contenders: int
) -> float:
    """The least budget whose phases buy one search prompt of each of ``categories`` (every drafter sampled on it,
    target-only run on it, and each drafter's k = 1 run) by PHASE_ENDS[1] after ``spent_s``, and ``needed`` held-out
    prompts of ``contenders`` in the rest, at ``prompt_s`` a target-only prompt; rounded up to 10 s."""
    search_s = prompt_s * (DRAFTING_SLOWDOWN * max(drafters, 1) + 1)
    least = max(
        needed * prompt_s * contenders / (1 - PHASE_ENDS[1]),
        (spent_s + drafters * prompt_s + categories * search_s) / PHASE_ENDS[1],
    )
    return math.ceil(least / 10) * 10


def _check_budget(
    config: TuneConfig, label: str, pool: Encoded, prompt_s: float, spent_s: float, drafters: int
) -> None:
    """Refuse, in one line, a budget that cannot buy the least search even on the first runtime alone, measured on one
    prompt (``prompt_s``, after ``spent_s`` opening it), and a prompt file too small to split: before the budget is
    spent. (The split checks again once every runtime is measured.)"""
    _, _, categories, needed = _deal(pool, config)
    spent_s += (PROBE_PROMPTS - 1) * prompt_s  # the rest of this runtime's measurement
    contenders = _contenders(config, drafters, 1)
    least = _least_budget_s(prompt_s, spent_s, categories, needed, drafters, contenders)
    if config.budget_s < least:
        raise ConfigError(
            f"--budget-s {config.budget_s:g} cannot buy a reliable choice here: a target-only prompt takes "
            f"{prompt_s:.1f} s on {label} ({spent_s:.0f} s to open and measure it), and sampling {drafters} drafter(s) "
            f"on {categories} search prompts and confirming {contenders} contenders on {needed} held-out prompts "
            f"needs more; give at least {least:.0f} s"
        )


def _split(
    pool: Encoded, config: TuneConfig, prompt_s: float, drafters: int, runtimes: int, spent_s: float
) -> tuple[Encoded, Encoded]:
    """The search part and the held-out part (_deal), as many of each as the budget's phases buy at ``prompt_s`` a
    prompt.

    Refuses, in one line, a prompt file or a budget that cannot give both parts every category and the held-out part
    MIN_HELD_OUT prompts."""
    search, held_out, categories, needed = _deal(pool, config)
    contenders = _contenders(config, drafters, runtimes)
    held_out_s = prompt_s * contenders
    search_s = prompt_s * (DRAFTING_SLOWDOWN * max(drafters, 1) + 1)
    confirm_budget = (1 - PHASE_ENDS[1]) * config.budget_s
    search_budget = PHASE_ENDS[1] * config.budget_s - spent_s - drafters * prompt_s  # less each one's k = 1 run
    held_out = held_out[: max(0, int(confirm_budget / held_out_s))]
    search = search[: max(0, int(search_budget / search_s))]
    if len(held_out) < needed or len(search) < categories:
        least = _least_budget_s(prompt_s, spent_s, categories, needed, drafters, contenders)
        raise ConfigError(
            f"--budget-s {config.budget_s:g} buys {len(search)} search and {len(held_out)} held-out prompts here "
            f"(a prompt takes about {prompt_s:.1f} s): a reliable choice needs {categories} and {needed}; "
            f"give at least {least:.0f} s"
        )
    return search, held_out


def _affordable(
    chosen: list[Candidate], measured: dict[str, RuntimeFigures], needed: int, left_s: float, notes: list[str]
) -> list[Candidate]:
    """The confirmation set, or, when ``needed`` held-out prompts of it would take more than ``left_s`` (a prompt
    costs about its runtime's target-only prompt time) and those of its part on the fastest runtime would not, that
    part alone: the contenders, target-only and default of slower runtimes go unconfirmed, with a note, rather than
    the budget run out with no profile."""

    def cost(candidates: list[Candidate]) -> float:
        return needed * sum(measured[c.runtime].prompt_s for c in candidates)

    fastest = max(measured.values(), key=lambda f: f.target_only_tokens_per_s).label
    kept = [c for c in chosen if c.runtime == fastest]
    if cost(chosen) <= left_s or cost(kept) > left_s or len(kept) == len(chosen):
        return chosen
    dropped = [c.label for c in chosen if c.runtime != fastest]
    notes.append(f"not confirmed for want of budget (slower runtimes): {', '.join(dropped)}")
    return kept


def _in_turns(items: Encoded) -> Encoded:
    """``items`` taken in turn from each category (round_robin), so that any prefix mixes the categories."""
    ids = {id(prompt): tokens for prompt, tokens in items}
    return [(prompt, ids[id(prompt)]) for prompt in round_robin([prompt for prompt, _ in items])]


def _first_prompt(target: Target, prompts: Encoded, base: GenerationConfig) -> DecodeStats:
    """A target-only run of the first prompt, after a warm-up: what a prompt costs on this runtime."""
    generator = Generator(target, "none", base)
    generator.generate(_warm_up(target), max_new_tokens=4)
    return generator.generate(prompts[0][1]).stats


def _measure_runtime(
    label: str,
    runtime: RuntimeConfig,
    target: Target,
    load_s: float,
    prompts: Encoded,
    base: GenerationConfig,
    first: DecodeStats | None = None,
) -> RuntimeFigures:
    """The runtime's cost curve (measured once per machine and cached, as the cost-model policy reads it) and a short
    target-only run (``first``: its first prompt's, run already)."""
    generator = Generator(target, "none", base)
    curve = generator.costs()
    generator.generate(_warm_up(target), max_new_tokens=4)
    runs = [first] if first is not None else []
    runs += [generator.generate(ids).stats for _, ids in prompts[len(runs) : PROBE_PROMPTS]]
    overheads = [max(0.0, (s.wall_s - s.ttft_s) / (s.steps - 1) - curve(1)) for s in runs if s.steps > 1]
    figures = RuntimeFigures(
        label,
        runtime,
        target,
        curve,
        statistics.median(s.tokens_per_s for s in runs),
        statistics.median(overheads) if overheads else 0.0,
        load_s,
        statistics.median(s.wall_s for s in runs),
    )
    _set_rates(figures, runs)
    return figures


def _set_rates(figures: RuntimeFigures, runs: list[DecodeStats]) -> None:
    """Target-only's rates from ``runs``: over whole prompts, after the first token, and the first token's time."""
    tokens = sum(s.new_tokens for s in runs)
    figures.target_only_tokens_per_s = tokens / sum(s.wall_s for s in runs)
    decoding = sum(s.wall_s - s.ttft_s for s in runs)
    figures.decode_tokens_per_s = (tokens - len(runs)) / decoding if decoding > 0 else figures.target_only_tokens_per_s
    figures.first_token_s = statistics.mean(s.ttft_s for s in runs)
    figures.tokens_per_prompt = tokens / len(runs)


def _calibrate_on(search: Encoded, by_speed: list[RuntimeFigures], base: GenerationConfig) -> None:
    """Target-only's rates on the search prompts, the ones the drafters are sampled on, measured on the fastest
    runtime; every other runtime's probe figures scale by the same factors (how these prompts differ from the probes
    is the text's: their length sets the first token's time, their answers' length the tokens per prompt)."""
    fastest = by_speed[0]
    before = (fastest.decode_tokens_per_s, fastest.first_token_s)
    _set_rates(fastest, [Generator(fastest.target, "none", base).generate(ids).stats for _, ids in search])
    decode, first = fastest.decode_tokens_per_s / before[0], fastest.first_token_s / (before[1] or 1.0)
    for figures in by_speed[1:]:
        figures.decode_tokens_per_s *= decode
        figures.first_token_s *= first
        figures.tokens_per_prompt = fastest.tokens_per_prompt
        figures.target_only_tokens_per_s = figures.prompt_rate(figures.decode_tokens_per_s)


def _warm_up(target: Target) -> list[int]:
    """Not a measured prompt: a drafter that learns would keep its answer."""
    return target.tokenizer(WARM_UP)["input_ids"]


def _drafter(spec: str, figures: RuntimeFigures) -> str | Drafter:
    """What a Generator drafts with for ``spec``: the default stays ``auto``, which Generator resolves from costs."""
    return spec if spec == DEFAULT_DRAFTER else build_drafter(spec, figures.target, figures.runtime)


def _sample_drafter(
    spec: str,
    by_speed: list[RuntimeFigures],
    prompts: Encoded,
    config: TuneConfig,
    base: GenerationConfig,
    deadline: float,
    notes: list[str],
) -> DrafterSample | None:
    """Every step of chains (or trees) of max_k drafts on the search prompts, on the drafter's fastest runtime, and
    its drafting time per step at max_k and at k = 1 (a chain drafter's fixed cost per step shows there).

    The first step of each prompt (it also reads the prompt) and those whose drafts the length limit cut are left out.
    The drafter is also built on every other runtime: the prediction covers only those it runs on.
    """
    sample = DrafterSample(spec)
    gen_config = replace(base, k=config.max_k, branches=TREE_BRANCHES if sample.tree else 1)
    generator: Generator | None = None  # on the fastest runtime it runs on; the others are only checked
    reasons = []
    for figures in by_speed:
        try:
            built = Generator(figures.target, _drafter(sample.drafter, figures), gen_config)
            built.completion(prompts[0][1])  # refuses what this backend cannot verify (trees on llama.cpp)
        except OPEN_ERRORS as exc:
            reasons.append(f"{figures.label}: {exc}")
            continue
        sample.runs_on.append(figures.label)
        generator = generator or built
    if generator is None:
        notes.append(f"drafter {spec} skipped: it runs on none of the measured runtimes ({'; '.join(reasons)})")
        return None
    generator.generate(_warm_up(generator.target), max_new_tokens=4)
    drafting: list[float] = []
    for _, ids in prompts:
        if sample.steps and time.perf_counter() > deadline:
            notes.append(
                f"drafter {spec} sampled on {len(sample.steps)} steps only: the budget's share for drafters was spent"
            )
            break
        for p, a, d in _full_steps(generator.generate(ids).stats, config.max_k, config.new_tokens):
            sample.steps.append((p, a))
            drafting.append(d)
    if drafting:
        sample.draft_s_by_k[config.max_k] = statistics.mean(drafting)
    if not sample.tree and config.max_k > 1:
        short = generator.generate(prompts[0][1], k=1).stats.draft_s_per_step[1:]
        if short:
            sample.draft_s_by_k[1] = statistics.mean(short)
    sample.sampled_draft_s_by_k = dict(sample.draft_s_by_k)
    return sample


def _full_steps(stats: DecodeStats, k: int, new_tokens: int) -> list[tuple[int, int, float]]:
    """(proposed, accepted, drafting seconds) of a fixed-k run's steps that drafted k in full: not the first (it also
    reads the prompt) nor those the length limit cut. Every step drafts (no guards), so the lists line up."""
    steps, produced = [], 0
    for step, (p, a) in enumerate(zip(stats.proposed_per_step, stats.accepted_per_step, strict=True)):
        room = new_tokens - produced - 1  # drafts this step could take before the length limit
        if step and room >= k and step < len(stats.draft_s_per_step):
            steps.append((p, a, stats.draft_s_per_step[step]))
        produced += a + 1
    return steps


def _predict(measured: dict[str, RuntimeFigures], samples: list[DrafterSample], max_k: int) -> list[Candidate]:
    """Tokens per second of every (runtime, drafter, k) the drafter runs on, replaying its sampled steps on the
    runtime's curve; best first.

    A step that proposed p tokens and had a accepted, replayed at k, proposes min(p, k) and keeps min(a, k); it costs a
    forward over min(p, k) + 1 tokens, the runtime's per-step overhead and the drafter's measured drafting time at k.
    Each runtime's decoding rates are scaled by its calibration, so that its target-only prediction is its measured
    decoding rate; a prompt's first token (prefill) costs what target-only's did, whatever drafts after it.
    """
    candidates = [Candidate(f.label, "none", 1, "fixed", f.target_only_tokens_per_s) for f in measured.values()]
    for s in samples:
        if not s.steps:
            continue
        for label in s.runs_on:
            f = measured[label]
            for k in [max_k] if s.tree else range(1, max_k + 1):  # a tree's nodes cannot be cut to a prefix
                tokens = sum(1 + min(a, k) for _, a in s.steps)
                seconds = sum(f.curve(min(p, k) + 1) + f.overhead_s + s.draft_s(k) for p, _ in s.steps)
                rate = f.prompt_rate(f.calibration * tokens / seconds)
                candidates.append(Candidate(label, s.spec, k, "fixed", rate))
    return sorted(candidates, key=lambda c: -(c.predicted_tokens_per_s or 0.0))


def _confirmation_set(
    candidates: list[Candidate], measured: dict[str, RuntimeFigures], count: int, max_k: int
) -> list[Candidate]:
    """The best predicted k of the ``count`` best (runtime, drafter) pairs, the cost-model policy for the best, and
    target-only and the library's default on each of their runtimes and on the fastest."""
    chosen: list[Candidate] = []
    pairs: set[tuple[str, str]] = set()
    for c in candidates:
        if c.drafter != "none" and (c.runtime, c.drafter) not in pairs and len(pairs) < count:
            pairs.add((c.runtime, c.drafter))
            chosen.append(c)
    if chosen and not chosen[0].drafter.endswith(TREE_SUFFIX):
        top = chosen[0]
        chosen.append(Candidate(top.runtime, top.drafter, max_k, "cost-model", top.predicted_tokens_per_s))
    fastest = max(measured.values(), key=lambda f: f.target_only_tokens_per_s).label
    runtimes = list(dict.fromkeys([fastest] + [c.runtime for c in chosen]))
    chosen += [c for c in candidates if c.drafter == "none" and c.runtime in runtimes]
    default = GenerationConfig()
    chosen += [Candidate(r, DEFAULT_DRAFTER, default.k, default.k_policy, None) for r in runtimes]
    return chosen


class Confirmation:
    """Contenders run on the held-out prompts in turns per prompt (rotated, so that drift falls on all alike), each
    prompt once a round; a drafter that learns is rebuilt every round, so that it sees each prompt for the first time.
    Per prompt, tokens and seconds add up over rounds; ``record`` writes the figures into the candidates."""

    def __init__(
        self, measured: dict[str, RuntimeFigures], prompts: Encoded, base: GenerationConfig, notes: list[str]
    ) -> None:
        self.measured, self.prompts, self.base, self.notes = measured, prompts, base, notes
        self.candidates: list[Candidate] = []
        self.generators: list[Generator | None] = []
        self.tokens: list[list[int]] = []
        self.seconds: list[list[float]] = []
        self.drafting: list[list[float]] = []
        self.rounds = 0

    def add(self, candidates: list[Candidate]) -> None:
        for c in candidates:
            self.candidates.append(c)
            self.generators.append(self._build(c))
            self.tokens.append([0] * len(self.prompts))
            self.seconds.append([0.0] * len(self.prompts))
            self.drafting.append([])

    def _build(self, c: Candidate) -> Generator | None:
        f = self.measured[c.runtime]
        spec = c.drafter.removesuffix(TREE_SUFFIX)
        config = replace(self.base, k=c.k, k_policy=c.k_policy, branches=TREE_BRANCHES if spec != c.drafter else 1)
        try:
            generator = Generator(f.target, _drafter(spec, f), config, runtime=f.runtime)
            generator.generate(_warm_up(f.target), max_new_tokens=4)
        except OPEN_ERRORS as exc:
            self.notes.append(f"{c.label} not confirmed: {exc}")
            return None
        if spec == DEFAULT_DRAFTER:
            c.drafts_with = generator.draft_name
            for i, other in enumerate(self.candidates):  # the same configuration under its own name runs once
                if (other.runtime, other.drafter, other.k, other.k_policy) == (
                    c.runtime,
                    c.drafts_with,
                    c.k,
                    c.k_policy,
                ):
                    self.generators[i] = None
                    self.notes.append(f"{other.label} is the default's configuration: confirmed as the default")
        return generator

    def run(self, deadline: float, only: list[Candidate] | None = None) -> float:
        """One round over the held-out prompts, for ``only`` those candidates if given, starting no prompt after
        ``deadline`` (a perf_counter time); its seconds."""
        began = time.perf_counter()
        members = [
            i
            for i, c in enumerate(self.candidates)
            if self.generators[i] and (only is None or any(c is o for o in only))
        ]
        if not members:
            return 0.0
        for index, (_, ids) in enumerate(self.prompts):
            if time.perf_counter() > deadline:
                self.notes.append(f"a confirmation round ran {index} of {len(self.prompts)} prompts: budget spent")
                break
            shift = (index + self.rounds) % len(members)
            for i in members[shift:] + members[:shift]:
                result = self.generators[i].generate(ids)  # type: ignore[union-attr]
                self.tokens[i][index] += len(result.token_ids)
                self.seconds[i][index] += result.stats.wall_s
                if self.candidates[i].k_policy == "fixed":
                    k = self.candidates[i].k
                    self.drafting[i] += [d for _, _, d in _full_steps(result.stats, k, self.base.max_new_tokens)]
        self.rounds += 1
        for i in members:
            if self.generators[i].drafter.capabilities.learns:  # type: ignore[union-attr]
                self.generators[i] = self._build(self.candidates[i])
        return time.perf_counter() - began

    def record(self) -> None:
        for c, tokens, seconds, drafting in zip(self.candidates, self.tokens, self.seconds, self.drafting, strict=True):
            if not sum(tokens):
                continue
            c.measured_tokens_per_s = sum(tokens) / sum(seconds)
            c.measured_by_prompt = [t / s if s else None for t, s in zip(tokens, seconds, strict=True)]
            by_category: dict[str, list[float]] = {}
            for (prompt, _), t, s in zip(self.prompts, tokens, seconds, strict=True):
                totals = by_category.setdefault(prompt.category, [0.0, 0.0])
                totals[0] += t
                totals[1] += s
            c.measured_by_category = {category: t / s for category, (t, s) in by_category.items() if s}
            if drafting:
                c.measured_draft_ms_per_step = 1000 * statistics.mean(drafting)


def _needed(held_out: Encoded) -> int:
    """The fewest held-out prompts a choice rests on: MIN_HELD_OUT, and one per category."""
    return min(max(MIN_HELD_OUT, len({p.category for p, _ in held_out})), len(held_out))


def _enough_confirmed(chosen: list[Candidate], held_out: Encoded, config: TuneConfig, spent_s: float) -> None:
    """Refuse to write a profile the confirmation could not back: the default (or target-only) and a contender
    measured on fewer than ``_needed`` held-out prompts."""
    runs = sorted((sum(rate is not None for rate in c.measured_by_prompt) for c in chosen), reverse=True)
    if len(runs) < 2 or runs[1] == 0:
        raise ConfigError(
            "fewer than two contenders could run on the held-out prompts (see the notes above): no profile written"
        )
    if runs[1] < _needed(held_out):
        raise ConfigError(
            f"--budget-s {config.budget_s:g} ran out after confirming on {runs[1]} held-out prompts "
            f"({spent_s:.0f} s): no profile written; give at least {math.ceil(1.5 * spent_s / 10) * 10:.0f} s"
        )


def _remeasure(
    chosen: list[Candidate],
    samples: list[DrafterSample],
    measured: dict[str, RuntimeFigures],
    config: TuneConfig,
    notes: list[str],
) -> tuple[list[Candidate], list[Candidate]]:
    """Where a contender ran more than OFF_BY from its prediction, say so; where it was a fixed-k chain on the runtime
    its drafter was sampled on and its drafting time per step there was more than OFF_BY from the drafter's modelled
    cost at that k, take the measured time as that cost, scale the cost at every other k alike, and predict again.
    Return the new predictions and those (at most ``config.confirm``) that now predict above the fastest measured, on
    a runtime still loaded, and were not confirmed."""
    by_spec = {s.spec: s for s in samples}
    changed = False
    for c in chosen:
        off = c.off_by
        if off is None or abs(off) <= OFF_BY:
            continue
        notes.append(
            f"{c.label}: predicted {c.predicted_tokens_per_s:.1f} tok/s, measured {c.measured_tokens_per_s:.1f} "
            f"({off:+.0%})"
        )
        sample = by_spec.get(c.drafter)
        if (
            sample is None
            or c.runtime != sample.runtime
            or c.k_policy != "fixed"
            or c.measured_draft_ms_per_step is None
            or sample.draft_s(c.k) <= 0
        ):
            continue
        # a cost misjudged at one k is misjudged at every k (a slow step, not a slow token): all scale alike
        scale = c.measured_draft_ms_per_step / 1000 / sample.draft_s(c.k)
        if abs(scale - 1) > OFF_BY:
            sample.draft_s_by_k = {k: s * scale for k, s in sample.draft_s_by_k.items()}
            sample.draft_s_by_k[c.k] = c.measured_draft_ms_per_step / 1000
            notes.append(f"{c.drafter}: drafting re-measured at k={c.k}, {scale:.2f}x its modelled cost")
            changed = True
    candidates = _predict(measured, samples, config.max_k)
    if not changed:
        return candidates, []
    fastest = max((_rate(c) for c in chosen), default=0.0)
    tried = {(c.runtime, c.drafter, c.k, c.k_policy) for c in chosen}
    fresh = [
        replace(c, second_round=True)
        for c in candidates
        if c.drafter != "none"
        and measured[c.runtime].target is not None
        and (c.runtime, c.drafter, c.k, c.k_policy) not in tried
        and (c.predicted_tokens_per_s or 0.0) > fastest
    ]
    return candidates, fresh[: config.confirm]


def _choose(confirmed: list[Candidate], needed: int) -> tuple[Candidate, Candidate, float]:
    """The contender with the best geometric mean of per-prompt speed ratios to the default (its fastest runtime), on
    the held-out prompts both ran (at least ``needed``), among those whose mean beats the margin and the noise (the
    standard error of the per-prompt log ratios); the default when none does. Returns the choice, the default it was
    held against and the ratio the choice (or, keeping the default, the best contender) had to beat it by."""
    defaults = [c for c in confirmed if c.drafter == DEFAULT_DRAFTER] or [c for c in confirmed if c.drafter == "none"]
    reference = max(defaults, key=_rate)
    contenders = []  # (mean log ratio, the bar it must beat, candidate)
    for c in confirmed:
        ratios = [
            math.log(a / b) for a, b in zip(c.measured_by_prompt, reference.measured_by_prompt, strict=False) if a and b
        ]
        if c is not reference and len(ratios) >= max(needed, 2):
            noise = statistics.stdev(ratios) / math.sqrt(len(ratios))
            contenders.append((statistics.mean(ratios), max(math.log(MARGIN), noise), c))
    winners = [entry for entry in contenders if entry[0] > entry[1]]
    if winners:
        _, bar, best = max(winners, key=lambda entry: entry[0])
        return best, reference, math.exp(bar)
    bar = max(contenders, key=lambda entry: entry[0])[1] if contenders else math.log(MARGIN)
    return reference, reference, math.exp(bar)
