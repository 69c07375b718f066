"""`specdec generate` and `specdec models` end to end on a saved tiny model folder."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from specdec.cli.main import app

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
    assert results["none"]["token_ids"] == results["prompt-lookup"]["token_ids"] == results[f"model:{tiny_folder}"]["token_ids"]
    assert results[f"model:{tiny_folder}"]["stats"]["acceptance_rate"] == 1.0


def test_generate_stream_prints_the_same_text(tiny_folder: Path) -> None:
    base = ["generate", "hello world", "--target", str(tiny_folder), "--max-new-tokens", "10", "--seed", "3", "--temperature", "0.9"]
    streamed = runner.invoke(app, base + ["--stream"])
    whole = runner.invoke(app, base + ["--json"])
    assert streamed.exit_code == whole.exit_code == 0
    assert streamed.stdout == json.loads(whole.stdout)["text"] + "\n"  # one newline after the stream


def test_models_lists_aliases() -> None:
    out = runner.invoke(app, ["models"])
    assert out.exit_code == 0
    assert "gemma-3-270m" in out.stdout and "cache folder" in out.stdout
