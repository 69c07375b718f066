"""`specdec generate` and `specdec models` end to end on a saved tiny model folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path

import typer
from typer.testing import CliRunner

from specdec.bench.batch import BatchBenchConfig
from specdec.bench.quality import QualityBenchConfig
from specdec.bench.runner import BenchConfig
from specdec.bench.serve_load import LoadConfig
from specdec.cli.main import app
from specdec.cli.options import default
from specdec.config import (
    BatchConfig,
    GenerationConfig,
    GuardConfig,
    RuntimeConfig,
    SamplingConfig,
)
from specdec.serving.config import RayConfig, ServeConfig
from specdec.training.distill import DistillConfig, DraftArch
from specdec.training.native_data import DataConfig
from specdec.training.ngram import NgramBuildConfig
from specdec.tuning.search import TuneConfig

runner = CliRunner()


def test_generate_json_has_documented_fields(tiny_folder: Path) -> None:
    args = ["generate", "abc abc abc", "--target", str(tiny_folder), "--max-new-tokens", "12", "--json"]
    results = {}
    for draft in ("none", "prompt-lookup", f"model:{tiny_folder}"):
        out = runner.invoke(app, args + ["--draft", draft, "--k", "3"])
        assert out.exit_code == 0, out.output
        results[draft] = payload = json.loads(out.stdout)
        assert set(payload) >= {"text", "token_ids", "stats"}
        stats = payload["stats"]
        for key in (
            "new_tokens target_forwards draft_tokens_proposed draft_tokens_accepted acceptance_rate "
            "mean_accepted_per_step tokens_per_s wall_s"
        ).split():
            assert key in stats
        assert stats["new_tokens"] == len(payload["token_ids"]) == 12
    assert (
        results["none"]["token_ids"]
        == results["prompt-lookup"]["token_ids"]
        == results[f"model:{tiny_folder}"]["token_ids"]
    )
    assert results[f"model:{tiny_folder}"]["stats"]["acceptance_rate"] == 1.0


def test_generate_stream_prints_the_same_text(tiny_folder: Path) -> None:
    base = [
        "generate",
        "hello world",
        "--target",
        str(tiny_folder),
        "--max-new-tokens",
        "10",
        "--seed",
        "3",
        "--temperature",
        "0.9",
    ]
    streamed = runner.invoke(app, base + ["--stream"])
    whole = runner.invoke(app, base + ["--json"])
    assert streamed.exit_code == whole.exit_code == 0
    assert streamed.stdout == json.loads(whole.stdout)["text"] + "\n"  # one newline after the stream


def test_models_lists_aliases() -> None:
    out = runner.invoke(app, ["models"])
    assert out.exit_code == 0
    assert "gemma-3-270m" in out.stdout and "cache folder" in out.stdout


LIBRARY_CONFIGS = (GenerationConfig, SamplingConfig, GuardConfig, RuntimeConfig)
SERVING_CONFIGS = (ServeConfig, BatchConfig, RayConfig)  # only `serve` builds these (`ppl --window` is another window)
COMMAND_CONFIGS = {
    "bench": BenchConfig,
    "bench-batch": BatchBenchConfig,
    "bench-serve": LoadConfig,
    "quality": QualityBenchConfig,
    "distill": DistillConfig,
    "distill-data": DataConfig,
    "ngram build": NgramBuildConfig,
    "tune": TuneConfig,
}
FIELD_OF_OPTION = {  # CLI option name -> config field name, where they differ
    "duration": "duration_s",
    "repetition_guard": "repetition",
}
PLURAL = {"k": "ks", "k_policy": "k_policies"}  # `bench` sweeps lists of these


def _cli_value(value: object) -> object:
    """A config default as the CLI spells it (lists are comma-separated strings)."""
    return (
        ",".join(map(str, value)) if isinstance(value, tuple) else str(value) if isinstance(value, DraftArch) else value
    )


def _same(cli: object, value: object) -> bool:
    """CLI and config defaults mean the same (None or False on the CLI and None or () in a config: unset, off)."""
    return cli == _cli_value(value) or (cli in (None, False) and value in (None, ()))


def _names(config: type) -> set[str]:
    return {f.name for f in fields(config)}


def _commands() -> Iterator[tuple[str, typer.core.TyperCommand]]:
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from ((f"{name} {sub}", c) for sub, c in command.commands.items())
        else:
            yield name, command


def test_every_cli_default_is_the_librarys_or_says_why() -> None:
    """Each option's default comes from its command's config and equals the library's unless its help says why not."""
    checked = 0
    for name, command in _commands():
        config = COMMAND_CONFIGS.get(name)
        own = (
            {f.name for f in fields(config) if f.default is not MISSING or f.default_factory is not MISSING}
            if config
            else set()
        )
        for param in command.params:
            if param.param_type_name != "option" or param.name is None:
                continue
            field_name = FIELD_OF_OPTION.get(param.name, param.name)
            if name == "bench" and param.name in PLURAL:
                field_name = PLURAL[param.name]
            if field_name in own:
                assert _same(param.default, default(config, field_name)), (name, param.name)
                checked += 1
            if name in ("distill", "distill-data", "ngram build"):
                continue  # training settings: their top_k, batch... are not generation's
            library = next(
                (
                    default(c, n)
                    for c in LIBRARY_CONFIGS + (SERVING_CONFIGS if name == "serve" else ())
                    for n in (param.name, field_name)
                    if n in _names(c)
                ),
                MISSING,
            )
            if library is MISSING:
                continue
            if not _same(param.default, library):
                help_text = " ".join((param.help or "").split())
                assert "deliberately" in help_text.lower() and f"library's default is {library}" in help_text, (
                    name,
                    param.name,
                )
            checked += 1
    assert checked > 60
