"""The long-generation quality benchmark: every guard and the lossy mode on vs off, over long outputs.

Each configuration decodes the same prompts (by default the open-writing and
chat prompts) to ``max_new_tokens`` with the same target and drafter, in one
process; sampled configurations use one seed per prompt. Every output is then
measured (quality/metrics.py) and each configuration is compared with its
baseline: greedy guards with plain greedy, sampled ones and the lossy mode with
plain sampling at the same temperature.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.bench.prompts import DEFAULT_PROMPTS, BenchPrompt, load_prompts
from specdec.bench.report import fmt, machine_line, pyplot
from specdec.bench.runner import machine_info
from specdec.config import GenerationConfig, GuardConfig, RuntimeConfig, SamplingConfig, TypicalAcceptance
from specdec.engine import Generator
from specdec.errors import ConfigError
from specdec.models import DEFAULT_TARGET
from specdec.quality.metrics import measure

SCHEDULE = (0.7, 1.2)  # the seed's temperature schedule


def quality_configs(temperature: float, drift_threshold: float) -> dict[str, tuple[str, GenerationConfig]]:
    """Each configuration's name -> (its baseline's name, its generation settings but length)."""
    sampled = SamplingConfig(temperature=temperature)
    typical = TypicalAcceptance()
    return {
        "greedy": ("greedy", GenerationConfig()),
        "greedy+repetition": ("greedy", GenerationConfig(guards=GuardConfig(repetition=True))),
        "greedy+anchor": ("greedy", GenerationConfig(guards=GuardConfig(anchor_every=100))),
        "greedy+drift": (
            "greedy",
            GenerationConfig(guards=GuardConfig(drift_threshold=drift_threshold, drift_anchor=True)),
        ),
        "greedy+typical (lossy)": ("greedy", GenerationConfig(typical_acceptance=typical)),
        "sampled": ("sampled", GenerationConfig(sampling=sampled)),
        "sampled+repetition": ("sampled", GenerationConfig(sampling=sampled, guards=GuardConfig(repetition=True))),
        "sampled+schedule": (
            "sampled",
            GenerationConfig(sampling=sampled, guards=GuardConfig(temperature_schedule=SCHEDULE)),
        ),
        "sampled+typical (lossy)": ("sampled", GenerationConfig(sampling=sampled, typical_acceptance=typical)),
        "sampled+typical+guards (lossy)": (
            "sampled",
            GenerationConfig(
                sampling=sampled,
                typical_acceptance=typical,
                guards=GuardConfig(repetition=True, temperature_schedule=SCHEDULE),
            ),
        ),
        "sampled+typical+anchor (lossy)": (
            "sampled",
            GenerationConfig(sampling=sampled, typical_acceptance=typical, guards=GuardConfig(anchor_every=100)),
        ),
    }


@dataclass(frozen=True)
class QualityBenchConfig:
    prompts: str = DEFAULT_PROMPTS
    target: str = DEFAULT_TARGET
    draft: str = "lookup-then-draft"
    categories: tuple[str, ...] = ("open-writing", "chat")
    per_category: int = 3
    max_new_tokens: int = 512
    k: int = GenerationConfig.k
    k_policy: str = GenerationConfig.k_policy
    temperature: float = 0.7
    drift_threshold: float = 0.2
    configs: tuple[str, ...] = ()  # empty: all of quality_configs
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        known = quality_configs(self.temperature, self.drift_threshold)
        unknown = [c for c in self.configs if c not in known]
        if unknown:
            raise ConfigError(f"unknown quality configuration(s) {', '.join(unknown)}: use some of {', '.join(known)}")
        if self.max_new_tokens < 100 or self.per_category < 1:
            raise ConfigError(
                "the quality benchmark needs max_new_tokens >= 100 (one drift window) and per_category >= 1"
            )


def run_quality_benchmark(config: QualityBenchConfig, advance: Callable[[str], None] = lambda _: None) -> dict:
    """Decode every prompt under every configuration and measure each output: figures per run and per configuration."""
    prompts = _select(load_prompts(config.prompts), config.categories, config.per_category)
    generator = Generator(config.target, config.draft, runtime=config.runtime)
    if generator.tokenizer is None:
        raise ConfigError("the quality benchmark measures text: the target needs a tokenizer")
    chosen = quality_configs(config.temperature, config.drift_threshold)
    names = configuration_names(config)
    # Warm-up: first-use costs stay out of the figures.
    for sampling in (SamplingConfig(), SamplingConfig(temperature=config.temperature)):
        generator.generate(
            prompts[0].prompt,
            GenerationConfig(k=config.k, k_policy=config.k_policy, max_new_tokens=32, sampling=sampling),
        )
    runs = []
    for name in names:
        base = chosen[name][1]
        for index, prompt in enumerate(prompts):
            advance(f"{name}: {prompt.id}")
            settings = GenerationConfig(
                k=config.k,
                k_policy=config.k_policy,
                max_new_tokens=config.max_new_tokens,
                seed=index,
                stop_on_eos=False,
                sampling=base.sampling,
                guards=base.guards,
                typical_acceptance=base.typical_acceptance,
            )
            result = generator.generate(prompt.prompt, settings)
            runs.append(
                {"config": name, "id": prompt.id, "category": prompt.category, "prompt": prompt.prompt}
                | result.to_dict()
            )
    advance("measuring")
    embedder, ignorable = generator.embedder(), generator.ignorable()
    decode = lambda ids: generator.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for run in runs:
        run["quality"] = measure(run["prompt"], run["token_ids"], decode, embedder, ignorable=ignorable).as_dict()
    return {
        "machine": machine_info(config.runtime),
        "config": asdict(config) | {"runtime": str(config.runtime)},
        "baselines": {name: chosen[name][0] for name in names},
        "runs": runs,
        "summary": _summary(runs, names, {name: chosen[name][0] for name in names}),
    }


def configuration_names(config: QualityBenchConfig) -> list[str]:
    """The configurations to run: those asked for (default: all), each with its baseline (compared in the same run)."""
    chosen = quality_configs(config.temperature, config.drift_threshold)
    names = list(config.configs) or list(chosen)
    return sorted({chosen[name][0] for name in names} - set(names)) + names


def _select(prompts: list[BenchPrompt], categories: tuple[str, ...], per_category: int) -> list[BenchPrompt]:
    chosen = []
    for category in categories:
        found = [p for p in prompts if p.category == category][:per_category]
        if not found:
            raise ConfigError(
                f"no prompt of category '{category}' in the prompt file: use --categories with some of its categories"
            )
        chosen += found
    return chosen


def _figures(runs: list[dict]) -> dict[str, float]:
    q = [r["quality"] for r in runs]
    tokens = sum(r["quality"]["tokens"] for r in runs)
    return {
        "tokens_per_s": sum(r["stats"]["new_tokens"] for r in runs) / sum(r["stats"]["wall_s"] for r in runs),
        "repeated_4gram_share": statistics.mean(x["repeated_4gram_share"] for x in q),
        "distinct_2": statistics.mean(x["distinct_2"] for x in q),
        "loops_per_1k_tokens": 1000 * sum(len(x["loop_onsets"]) for x in q) / tokens,
        "looping_share": statistics.mean(x["looping_share"] for x in q),
        "drift_mean": statistics.mean(x["drift_mean"] for x in q),
        "drift_last_window": statistics.mean(x["drift_curve"][-1] for x in q if x["drift_curve"]),
        "contradictions": sum(len(x["contradictions"]) for x in q),
        "acceptance_rate": statistics.mean(r["stats"]["acceptance_rate"] for r in runs),
        "anchors": sum(r["stats"]["anchors"] for r in runs),
        "guard_share": sum(r["stats"]["guard_s"] for r in runs) / sum(r["stats"]["wall_s"] for r in runs),
        "drift_events": sum(e["kind"] == "drift" for r in runs for e in r["stats"]["events"]),
        "loop_blocks": sum(e["kind"] == "loop_blocked" for r in runs for e in r["stats"]["events"]),
    }


def _summary(runs: list[dict], names: list[str], baselines: dict[str, str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per configuration, per category and "all": the figures, with speed relative to the configuration's baseline."""
    categories = sorted({r["category"] for r in runs})
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        summary[name] = {}
        for category in [*categories, "all"]:
            mine = [r for r in runs if r["config"] == name and category in (r["category"], "all")]
            summary[name][category] = _figures(mine)
    for name in names:
        for category, figures in summary[name].items():
            figures["speed_vs_baseline"] = figures["tokens_per_s"] / summary[baselines[name]][category]["tokens_per_s"]
    return summary


COLUMNS = (
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speed vs baseline", "speed_vs_baseline", "{:.2f}x"),
    ("repeated 4-grams", "repeated_4gram_share", "{:.1%}"),
    ("in a loop", "looping_share", "{:.1%}"),
    ("loop onsets / 1k tokens", "loops_per_1k_tokens", "{:.2f}"),
    ("distinct-2", "distinct_2", "{:.3f}"),
    ("drift: mean sim.", "drift_mean", "{:.3f}"),
    ("last window sim.", "drift_last_window", "{:.3f}"),
    ("contradiction pairs", "contradictions", "{:d}"),
    ("acceptance", "acceptance_rate", "{:.0%}"),
    ("time in guards", "guard_share", "{:.1%}"),
    ("anchors", "anchors", "{:d}"),
    ("drift events", "drift_events", "{:d}"),
)


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        "# specdec quality benchmark",
        "",
        f"Target `{cfg['target']}`, drafter `{cfg['draft']}`, k <= {cfg['k']} ({cfg['k_policy']}), "
        f"{cfg['max_new_tokens']} new tokens (EOS ignored), {cfg['per_category']} prompts per category from "
        f"`{cfg['prompts']}`, sampled configurations at temperature {cfg['temperature']} with one seed per prompt; "
        f"drift threshold {cfg['drift_threshold']}.",
        machine_line(results["machine"]),
        "",
        "Baselines: " + ", ".join(f"`{n}` vs `{b}`" for n, b in results["baselines"].items() if n != b) + ".",
    ]
    for category in next(iter(results["summary"].values())):
        lines += ["", f"## {category}", "", "| configuration | " + " | ".join(c[0] for c in COLUMNS) + " |"]
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for name, per_category in results["summary"].items():
            f = per_category[category]
            lines.append(f"| {name} | " + " | ".join(fmt(f[key], pattern) for _, key, pattern in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> list[Path]:
    """Drift and repetition along the output (mean over prompts per window), one panel per category."""
    plt = pyplot()

    categories = sorted({r["category"] for r in results["runs"]})
    paths = []
    for key, label, filename in (
        ("drift_curve", "similarity of the window to the prompt", "drift.png"),
        ("repetition_curve", "share of the window's 4-grams seen before", "repetition.png"),
    ):
        fig, axes = plt.subplots(1, len(categories), figsize=(6 * len(categories), 4), squeeze=False)
        for ax, category in zip(axes[0], categories, strict=True):
            for name in results["summary"]:
                curves = [
                    r["quality"][key] for r in results["runs"] if r["config"] == name and r["category"] == category
                ]
                width = min(len(c) for c in curves)
                ax.plot(
                    [100 * (i + 1) for i in range(width)],
                    [statistics.mean(c[i] for c in curves) for i in range(width)],
                    marker="o",
                    label=name,
                )
            ax.set_title(category)
            ax.set_xlabel("output tokens (end of 100-token window)")
            ax.set_ylabel(label)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(out / filename)
        plt.close(fig)
        paths.append(out / filename)
    return paths


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(markdown(results))
    plot(results, out)
