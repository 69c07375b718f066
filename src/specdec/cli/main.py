"""`specdec`: the command groups (generate, bench, serve, train, tune) on one typer app, `specdec models` and
`specdec prompts`."""

from __future__ import annotations

import faulthandler
import sys

import typer
from rich.table import Table

from specdec.cli import bench, doctor, generate, serve, train, tune
from specdec.cli.options import console
from specdec.models import ALIASES

app = typer.Typer(
    help="Lossless speculative decoding for LLM text generation.", no_args_is_help=True, add_completion=False
)
app.command()(generate.generate)
app.command()(generate.demo)
app.command()(bench.bench)
app.command("bench-batch")(bench.bench_batch)
app.command()(bench.quality)
app.command()(serve.serve)
app.command("bench-serve")(bench.bench_serve)
app.command()(bench.ppl)
app.command()(train.distill)
app.command("distill-data")(train.distill_data)
app.command()(tune.tune)
app.command()(doctor.doctor)
ngram_app = typer.Typer(help="Corpus n-gram tables for --draft ngram:FILE.", no_args_is_help=True)
ngram_app.command("build")(train.ngram_build)
app.add_typer(ngram_app, name="ngram")


@app.command()
def models() -> None:
    """List the bundled model aliases, where their files are, and whether they are converted and cached."""
    from specdec.models.registry import bundled_draft, cache_root, converted_path, is_cached, resolve

    table = Table("alias", "description", "package", "converted copy", "bundled draft")
    for alias in ALIASES.values():
        installed = alias.installed()
        source = resolve(alias.name)
        cached = f"cached: {converted_path(source)}" if is_cached(source) else "not yet (converted on first use)"
        draft = "--draft lookup-then-draft" if bundled_draft(alias.name) else "-"
        table.add_row(
            alias.name, alias.description, "installed" if installed else f"missing: {alias.install}", cached, draft
        )
    console.print(table)
    console.print(f"cache folder: {cache_root()} (set SPECDEC_CACHE to move it)")


@app.command()
def prompts() -> None:
    """List the prompt sets shipped with specdec (pass a name to --prompts), with their sizes and categories."""
    from collections import Counter

    from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts, prompt_sets

    table = Table("name", "prompts", "categories", "file")
    for name, path in prompt_sets().items():
        counts = Counter(p.category for p in load_prompts(path))
        label = f"{name} (the benchmarks' default)" if name == DEFAULT_PROMPTS else name
        table.add_row(label, str(sum(counts.values())), ", ".join(f"{c} {n}" for c, n in counts.items()), str(path))
    console.print(table)


def main() -> None:
    faulthandler.enable()  # a crash in native code (torch, llama.cpp) prints where it happened
    app(sys.argv[1:])
