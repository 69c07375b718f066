"""A tuning run on disk: profile.json, results.json, report.md (predicted against measured) and a plot."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.bench.report import fmt, pyplot
from specdec.profile import Profile
from specdec.tuning.search import OFF_BY

PLOT = "predicted_vs_measured.png"


def write_tune_report(profile: Profile, results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(markdown(results))
    _plot(results, out / PLOT)


def markdown(results: dict) -> str:
    cfg, machine, measured = results["config"], results["machine"], results["profile"]["measured"]
    sampling = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    split = results["prompts"]
    lines = [
        "# specdec tune",
        "",
        f"Target `{cfg['target']}`, prompts `{cfg['prompts']}`, {sampling}, {cfg['new_tokens']} new tokens per prompt, "
        f"budget {cfg['budget_s']:g} s (used {results['elapsed_s']:.0f} s).",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, accelerator {machine['accelerator']}.",
        "",
        f"**Chosen: {results['chosen']}** (profile.json): {measured['tokens_per_s']:.1f} tok/s held out, "
        f"{measured['speedup_vs_target_only']:.2f}x target-only and {measured['speedup_vs_default']:.2f}x the default "
        f"({results['default']}). A contender had to beat the default by {results['threshold']:.3f}x "
        "(the larger of the margin and the run's noise, the standard error of the per-prompt ratio).",
        "",
        "## Prompts",
        "",
        f"Search ({len(split['search'])}: drafters sampled, predictions made): {', '.join(split['search'])}.",
        "",
        f"Held out ({len(split['held_out'])}: every contender confirmed, the profile's figures): "
        f"{', '.join(split['held_out'])}.",
        "",
        "## Runtimes",
        "",
        "| runtime | load s | forward ms at n = 1 / 5 / 9 / 17 | overhead ms/step | target-only tok/s |",
        "|---|---|---|---|---|",
    ]
    for label, r in results["runtimes"].items():
        cost = " / ".join(fmt(r["cost_ms"].get(n, r["cost_ms"].get(str(n))), "{:.1f}") for n in (1, 5, 9, 17))
        lines.append(
            f"| {label} | {r['load_s']:.1f} | {cost} | {r['overhead_ms']:.1f} | {r['target_only_tokens_per_s']:.1f} |"
        )
    lines += [
        "",
        "Cost curves are measured once per machine and runtime and cached (`$SPECDEC_CACHE/costs/`), "
        "as the cost-model policy reads them;",
        "the overhead is a target-only step's time beyond the forward; target-only tok/s is on the search prompts "
        "(measured on the fastest runtime, the others' short probe scaled alike).",
        "",
        "## Drafters (chains of max k on the search prompts, on the fastest runtime each runs on)",
        "",
        "| drafter | sampled on | runs on | steps | acceptance | accepted/step | draft ms/step by k |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, d in results["drafters"].items():
        by_k = ", ".join(f"{k}: {ms:.2f}" for k, ms in d["sampled_draft_ms_by_k"].items())
        if d["draft_ms_by_k"] != d["sampled_draft_ms_by_k"]:
            by_k += "; re-measured " + ", ".join(f"{k}: {ms:.2f}" for k, ms in d["draft_ms_by_k"].items())
        lines.append(
            f"| {spec} | {d['sampled_on']} | {', '.join(d['runs_on'])} | {d['steps']} | {d['acceptance']:.0%} | "
            f"{d['accepted_per_step']:.2f} | {by_k} |"
        )
    lines.append("")
    lines.append(
        "Drafting time per step is measured at k = max k on the search prompts and at k = 1 on one of them, and "
        "interpolated between (trees: max k only); a fixed-k contender whose drafting cost missed its model by more "
        f"than {OFF_BY:.0%} in confirmation re-measures it (every k scaled alike)."
    )
    categories = results["categories"]
    lines += ["", "## Contenders confirmed on the held-out prompts (tok/s)", ""]
    lines.append("| candidate | predicted | measured | measured / predicted | " + " | ".join(categories) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(categories))
    for c in sorted(results["confirmed"], key=lambda c: -(c["measured_tokens_per_s"] or 0)):
        off = c["off_by"]
        ratio = (
            "" if off is None else f"{1 + off:.2f}" + (f" (off by more than {OFF_BY:.0%})" if abs(off) > OFF_BY else "")
        )
        by_category = " | ".join(fmt(c["measured_by_category"].get(category), "{:.1f}") for category in categories)
        mark = " (second round)" if c["second_round"] else ""
        lines.append(
            f"| {c['label']}{mark} | {fmt(c['predicted_tokens_per_s'], '{:.1f}')} "
            f"| {fmt(c['measured_tokens_per_s'], '{:.1f}')} | {ratio} | {by_category} |"
        )
    lines.append("")
    lines.append(
        "A cost-model candidate carries the best fixed k's prediction: the policy aims at that k step by step. "
        "The default (`auto`, cost-model k) is not predicted."
    )
    lines += [
        "",
        "## Every candidate, predicted (best k of each runtime and drafter, after any re-measurement)",
        "",
        "| candidate | predicted tok/s |",
        "|---|---|",
    ]
    seen = set()
    for c in results["candidates"]:
        if (c["runtime"], c["drafter"]) not in seen:
            seen.add((c["runtime"], c["drafter"]))
            lines.append(f"| {c['label']} | {c['predicted_tokens_per_s']:.1f} |")
    if results["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    """Predicted against measured tokens/s of the confirmed candidates (the diagonal is a perfect prediction)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    confirmed = [c for c in results["confirmed"] if c["measured_tokens_per_s"] and c["predicted_tokens_per_s"]]
    for c in confirmed:
        ax.scatter(
            c["predicted_tokens_per_s"], c["measured_tokens_per_s"], marker="o" if c["drafter"] != "none" else "s"
        )
        ax.annotate(c["label"], (c["predicted_tokens_per_s"], c["measured_tokens_per_s"]), fontsize=6)
    top = (
        max([c["predicted_tokens_per_s"] for c in confirmed] + [c["measured_tokens_per_s"] for c in confirmed] + [1.0])
        * 1.1
    )
    ax.plot([0, top], [0, top], color="grey", linewidth=0.5)
    ax.set(
        xlim=(0, top),
        ylim=(0, top),
        xlabel="predicted tokens/s",
        ylabel="measured tokens/s",
        title="specdec tune: confirmed candidates",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
