"""Write a benchmark's results: results.json, report.md and matplotlib plots."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend, imported when a plot is drawn (importing it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PLOTS = ("speedup_by_category.png", "accepted_per_step.png", "tokens_per_s_vs_k.png")


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(markdown(results))
    _plot_speedups(results, out / PLOTS[0])
    _plot_histograms(results, out / PLOTS[1])
    _plot_k(results, out / PLOTS[2])


def fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    """A figure for a table cell; "-" where it does not apply."""
    return "-" if value is None else pattern.format(value)


def machine_line(machine: dict) -> str:
    return f"Machine: {machine['device']}, {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}."


def markdown(results: dict) -> str:
    machine, cfg = results["machine"], results["config"]
    lines = [
        "# specdec benchmark",
        "",
        f"Target `{cfg['target']}` ({machine.get('backend', 'transformers')} backend, {machine['dtype']}), "
        f"{cfg['prompt_count']} prompts from `{cfg['prompts']}`, {cfg['max_new_tokens_used']} new tokens, "
        f"temperature {cfg['temperature']}, {cfg['repeats']} repeat(s).",
        machine_line(machine),
        "",
        "Speed-up is tokens/s against specdec's target-only `none` in the same run; "
        "peers also against their own greedy.",
        "Predicted: Leviathan et al. expected tokens per step over step cost (ideal: verification costs one step;",
        "measured: this machine's verification cost). "
        "Identical: share of prompts whose output equals `none`'s (greedy runs).",
        "",
    ]
    greedy = cfg["temperature"] == 0  # identity with `none` means something only for greedy runs
    header = (
        "| method | tok/s (median, min-max) | vs none | vs own greedy | predicted (ideal / measured) | acceptance "
        "| tokens/step | fwd/token | TTFT s | peak mem Δ MB | identical |"
    )
    for category in results["categories"]:
        lines += [f"## {category}", "", header, "|" + "---|" * 11]
        for name, m in results["methods"].items():
            r = m["categories"][category]
            lines.append(
                f"| {name} | {r['tokens_per_s']:.2f} ({r['tokens_per_s_min']:.2f}-{r['tokens_per_s_max']:.2f}) "
                f"| {r['speedup_vs_none']:.2f}x | {fmt(r['speedup_vs_own_greedy'], '{:.2f}x')} "
                f"| {fmt(r['predicted_speedup'], '{:.2f}x')} / {fmt(r['predicted_speedup_measured_costs'], '{:.2f}x')} "
                f"| {fmt(r['acceptance_rate'], '{:.0%}')} | {fmt(r['tokens_per_step'])} "
                f"| {fmt(r['target_forwards_per_token'])} "
                f"| {fmt(r['ttft_s'])} | {m['peak_memory_increase_vs_none_mb']:+.0f} "
                f"| {fmt(r['identical_share'], '{:.0%}') if greedy else 'n/a'} |"
            )
        lines.append("")
    best = max(
        (
            n
            for n, m in results["methods"].items()
            if m["family"] == "specdec" and n != "none" and not n.startswith("oracle")
        ),
        key=lambda n: results["methods"][n]["categories"]["overall"]["speedup_vs_none"],
        default=None,
    )
    if best:
        m = results["methods"][best]
        increase = m["peak_memory_increase_vs_none"]
        lines += [
            "## Hardware row (seed format, best specdec method overall)",
            "",
            "| device | method | speed-up | peak memory increase |",
            "|---|---|---|---|",
            f"| {machine['device']} ({machine['cpu']}) | {best} "
            f"| {m['categories']['overall']['speedup_vs_none']:.2f}x | {increase:+.0%} |",
            "",
        ]
    drafting = [(n, m) for n, m in results["methods"].items() if m["family"] == "specdec" and m["k"] is not None]
    if drafting:
        lines += [
            "## Drafting: k chosen per step and drafter latency (all prompts)",
            "",
            "| method | k policy | k histogram (k: steps) | draft latency p50 / p99 ms |",
            "|---|---|---|---|",
        ]
        for name, m in drafting:
            r = m["categories"]["overall"]
            histogram = ", ".join(f"{k}: {count}" for k, count in m["k_histogram"].items())
            lines.append(
                f"| {name} | {m['k_policy']} | {histogram} "
                f"| {fmt(r['draft_ms_p50'], '{:.3f}')} / {fmt(r['draft_ms_p99'], '{:.3f}')} |"
            )
        lines.append("")
    positions = results.get("positions", {})
    groups = [point["positions"] for point in next(iter(positions.values()), [])]
    if len(groups) > 1:
        lines += [
            "## Along the run (prompts by position in their category, in run order)",
            "",
            "Speed-up over target-only (tokens per step) on the prompts at these positions: a drafter that learns "
            "from earlier answers gets faster along the run.",
            "",
            "| method | " + " | ".join(groups) + " |",
            "|---|" + "---|" * len(groups),
        ]
        for name, points in positions.items():
            cells = [f"{p['speedup_vs_none']:.2f}x ({fmt(p['tokens_per_step'], '{:.2f}')})" for p in points]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    curve = results["target_forward_cost_ms"]
    lines += [
        "## Target forward cost on this machine (n tokens after 64 cached)",
        "",
        "| n | " + " | ".join(str(n) for n in curve) + " |",
        "|---|" + "---|" * len(curve),
        "| ms | " + " | ".join(f"{ms:.1f}" for ms in curve.values()) + " |",
        "| vs n = 1 | " + " | ".join(f"{ms / next(iter(curve.values())):.2f}x" for ms in curve.values()) + " |",
        "",
    ]
    if results["greedy_mismatches"]:
        lines += (
            ["## Greedy mismatches", ""]
            + [
                f"- {x['method']} on `{x['prompt']}`: first difference at token {x['first_difference']}"
                for x in results["greedy_mismatches"]
            ]
            + [""]
        )
    if results["notes"]:
        lines += ["## Notes", ""] + [f"- {note}" for note in results["notes"]] + [""]
    return "\n".join(lines)


def _plot_speedups(results: dict, path: Path) -> None:
    plt = pyplot()
    names = [n for n in results["methods"] if n != "none"]
    categories = results["categories"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * max(1, len(names)) / 2), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        values = [results["methods"][name]["categories"][c]["speedup_vs_none"] for c in categories]
        ax.bar([j + i * width for j in range(len(categories))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(categories))], categories)
    ax.set_ylabel("speed-up vs target-only (none)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_histograms(results: dict, path: Path) -> None:
    plt = pyplot()
    names = [n for n, m in results["methods"].items() if m["accepted_per_step_histogram"] and n != "none"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        hist = {int(k): v for k, v in results["methods"][name]["accepted_per_step_histogram"].items()}
        total = sum(hist.values())
        ax.plot(sorted(hist), [hist[k] / total for k in sorted(hist)], marker="o", label=name)
    ax.set_xlabel("draft tokens accepted in a step")
    ax.set_ylabel("share of steps")
    if names:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_k(results: dict, path: Path) -> None:
    plt = pyplot()
    series: dict[str, list[tuple[int, float]]] = {}
    for name, m in results["methods"].items():
        if m["k"] is not None:
            series.setdefault(name.rsplit("@k", 1)[0], []).append((m["k"], m["categories"]["overall"]["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        points.sort()
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=name)
    ax.axhline(
        results["methods"]["none"]["categories"]["overall"]["tokens_per_s"], color="black", linestyle="--", label="none"
    )
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("tokens/s (overall)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
