"""`specdec tune`: measure this machine, target and prompts; write the fastest exact configuration as a profile."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from specdec.cli.options import (
    Overwrite,
    Prompts,
    Target,
    console,
    default,
    fresh_output,
    name_list,
    progress,
    say,
    user_errors,
)
from specdec.errors import ConfigError
from specdec.tuning.search import TuneConfig


@user_errors
def tune(
    target: Target = default(TuneConfig, "target"),
    prompts: Prompts = default(TuneConfig, "prompts"),
    budget_s: Annotated[
        float,
        typer.Option(
            "--budget-s",
            help="Seconds the search may take, model loading included (the last short run may overrun it); one too "
            "small for a reliable choice is refused after the first prompt, naming the budget to give.",
        ),
    ] = default(TuneConfig, "budget_s"),
    sampling_mode: Annotated[
        str, typer.Option("--sampling", help="greedy, or a temperature (like 0.7) to tune sampled decoding.")
    ] = "greedy",
    max_k: Annotated[int, typer.Option(help="Most draft tokens per step considered.")] = default(TuneConfig, "max_k"),
    runtimes: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated runtimes to measure (native, llama.cpp, transformers/cpu-vnni, transformers/cpu, "
            "transformers/float32; on CUDA transformers/bf16); default: every one that runs here."
        ),
    ] = None,
    drafters: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated drafters to sample (any --draft spec, DRAFTER+tree for trees); default: "
            "prompt-lookup, suffix and the drafts shipped for the target. Target-only and the default (auto) always "
            "run."
        ),
    ] = None,
    new_tokens: Annotated[
        int, typer.Option(help="New tokens per prompt in the sampling and confirmation runs.")
    ] = default(TuneConfig, "new_tokens"),
    confirm: Annotated[
        int, typer.Option(help="Best predicted runtime-and-drafter pairs confirmed by a real run.")
    ] = default(TuneConfig, "confirm"),
    out: Annotated[Path, typer.Option(help="Output folder: profile.json, report.md, results.json and a plot.")] = Path(
        "tune-out"
    ),
    overwrite: Overwrite = False,
) -> None:
    """Find the fastest exact configuration (runtime, precision, drafter, k) for this machine, target and prompts."""
    from specdec.bench.report import fmt
    from specdec.tuning.report import PLOT, write_tune_report
    from specdec.tuning.search import plan
    from specdec.tuning.search import tune as search

    fresh_output(out, overwrite)
    config = TuneConfig(
        target=target,
        prompts=prompts,
        budget_s=budget_s,
        temperature=_temperature(sampling_mode),
        max_k=max_k,
        runtimes=name_list(runtimes),
        drafters=name_list(drafters),
        new_tokens=new_tokens,
        confirm=confirm,
    )
    _, _, units = plan(config)
    with progress(units) as advance:
        profile, results = search(config, advance)
    write_tune_report(profile, results, out)
    for note in results["notes"]:
        say("note:", "yellow", note)
    table = Table("contender", "predicted tok/s", "measured tok/s (held-out prompts)")
    for c in sorted(results["confirmed"], key=lambda c: -(c["measured_tokens_per_s"] or 0)):
        table.add_row(c["label"], fmt(c["predicted_tokens_per_s"], "{:.1f}"), fmt(c["measured_tokens_per_s"], "{:.1f}"))
    console.print(table)
    m = profile.measured
    console.print(
        f"chosen: {results['chosen']}, {m['tokens_per_s']:.1f} tok/s on {m['held_out_prompts']} held-out prompts, "
        f"{m['speedup_vs_target_only']:.2f}x the fastest target-only, {m['speedup_vs_default']:.2f}x the default "
        f"({results['elapsed_s']:.0f} s)\n"
        f"profile: {out / 'profile.json'} (use it: specdec generate --profile {out / 'profile.json'} ...); "
        f"report: {out / 'report.md'}, plot: {out / PLOT}"
    )


def _temperature(sampling: str) -> float:
    if sampling == "greedy":
        return 0.0
    try:
        value = float(sampling)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"--sampling is greedy or a temperature above 0 (like 0.7), got '{sampling}'")
    return value
