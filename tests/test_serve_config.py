"""The serve rules as the library holds them (ServeConfig, the Ray replica spec), profiles as typed settings, and the
CLI's functions kept short: fast checks, no model loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specdec.cli.main import app
from specdec.cli.options import Tuned, with_profile
from specdec.config import BatchConfig, GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.errors import ConfigError
from specdec.profile import Profile
from specdec.serving.config import ServeConfig
from specdec.serving.ray_serve import ReplicaSpec, app_builder

CLI = Path(__file__).parents[1] / "src" / "specdec" / "cli"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"host": "0.0.0.0"}, "serves beyond this machine without API keys: set --api-key"),
        ({"host": "192.168.1.4", "api_keys": ()}, "or pass --insecure-no-auth"),
        ({"suffix_save_every_s": 60}, "--suffix-save-every sets how often --suffix-cache is written"),
        ({"suffix_scope": "key"}, "no keys are set"),
    ],
)
def test_a_serve_config_breaking_a_rule_is_refused_from_python(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**settings)


def test_what_the_rules_allow() -> None:
    assert not ServeConfig().open_beyond_loopback
    assert ServeConfig(host="0.0.0.0", insecure_no_auth=True).open_beyond_loopback
    assert not ServeConfig(host="0.0.0.0", api_keys=("sk-k",)).open_beyond_loopback
    assert ServeConfig(suffix_cache="history.bin", suffix_save_every_s=60).suffix_settings == (
        "--suffix-cache",
        "--suffix-save-every",
    )
    assert ServeConfig().suffix_settings == ()
    ServeConfig().check_drafter("prompt-lookup")  # no suffix settings: any drafter
    for draft in ("suffix", "auto"):
        ServeConfig(suffix_max_tokens=10).check_drafter(draft)
    ServeConfig(suffix_max_tokens=10).check_drafter("auto", "suffix")


def test_suffix_settings_need_a_drafter_that_keeps_a_history() -> None:
    config = ServeConfig(suffix_scope="global", suffix_max_tokens=10)
    with pytest.raises(
        ConfigError, match="^--suffix-scope, --suffix-max-tokens set.s. the suffix .*add --draft suffix$"
    ):
        config.check_drafter("prompt-lookup")
    with pytest.raises(ConfigError, match="'auto' drafts with prompt-lookup on this machine: add --draft suffix"):
        config.check_drafter("auto", "prompt-lookup")


@pytest.mark.parametrize(
    ("draft", "serve", "message"),
    [
        (
            "prompt-lookup",
            ServeConfig(suffix_scope="request"),
            "^--suffix-scope set.s. the suffix drafter's history: add",
        ),
        ("auto", ServeConfig(suffix_max_tokens=10), "with --ray each replica makes 'auto' concrete on its own"),
        ("suffix", ServeConfig(suffix_cache="history.bin"), "--suffix-cache keeps one server's history: drop it"),
    ],
)
def test_a_replica_spec_breaking_a_rule_is_refused_from_python(draft: str, serve: ServeConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplicaSpec("some-model", draft, serve=serve)


def test_the_replica_spec_allows_suffix_settings_with_the_suffix_drafter_and_the_config_file_enforces_the_rules() -> (
    None
):
    ReplicaSpec("some-model", "suffix", serve=ServeConfig(suffix_max_tokens=10))
    ReplicaSpec("some-model", "auto")
    with pytest.raises(ConfigError, match="makes 'auto' concrete"):
        app_builder({"suffix_max_tokens": 10})  # the default drafter is auto


def test_the_cli_states_the_same_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    import specdec.models
    from specdec.serving import ray_serve

    def loaded(*args: object) -> None:
        raise ConfigError("the rules passed: the target would load now")

    monkeypatch.setattr(ray_serve, "serve_on_ray", loaded)
    monkeypatch.setattr(specdec.models, "open_target", loaded)
    runner = CliRunner()
    cases = {
        ("--ray", "--draft", "suffix", "--suffix-cache", "h.bin"): "--suffix-cache keeps one server's history",
        ("--ray", "--suffix-max-tokens", "10"): "with --ray each replica makes 'auto' concrete",
        ("--draft", "prompt-lookup", "--suffix-scope", "global"): "--suffix-scope set(s) the suffix drafter's history",
        ("--host", "0.0.0.0", "--insecure-no-auth"): "anyone who can reach it can use it",
    }
    for args, message in cases.items():
        result = runner.invoke(app, ["serve", *args], env={"SPECDEC_API_KEYS": ""})
        said = " ".join(result.output.split())
        assert result.exit_code == 2 and message in said and "Traceback" not in said, (args, said)
        assert ("the target would load now" in said) == ("--insecure-no-auth" in args)


def test_serve_takes_window_as_k_caps_former_name_and_refuses_both_disagreeing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from specdec.cli import serve

    built: list[BatchConfig] = []
    monkeypatch.setattr(serve, "_serve_locally", lambda *args: built.append(args[4]))  # the BatchConfig; no server
    runner = CliRunner()

    def batch(*args: str) -> BatchConfig:
        result = runner.invoke(app, ["serve", *args])
        assert result.exit_code == 0, result.output
        return built.pop()

    assert batch() == BatchConfig(k_cap="dynamic")
    assert batch("--window", "fixed") == batch("--k-cap", "fixed") == BatchConfig(k_cap="fixed")
    assert batch("--k-cap", "fixed", "--window", "fixed") == BatchConfig(k_cap="fixed")  # both, agreeing
    # a profile's k_cap (fixed) gives way to the command line's, under either name
    profile = str(_profile(tmp_path / "p.json"))
    assert batch("--profile", profile, "--target", "tuned-model") == BatchConfig(k_cap="fixed")
    assert batch("--profile", profile, "--target", "tuned-model", "--window", "dynamic") == BatchConfig()
    for args in (["--k-cap", "dynamic", "--window", "fixed"], ["--window", "dynamic", "--k-cap", "fixed"]):
        result = runner.invoke(app, ["serve", *args])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
        assert lines[0].startswith("error: --k-cap ") and "disagree" in lines[0] and "give --k-cap alone" in lines[0]
    assert not built


def _profile(path: Path) -> Path:
    Profile(
        target="tuned-model",
        drafter="prompt-lookup",
        runtime=RuntimeConfig(backend="transformers", dtype="bfloat16"),
        generation=GenerationConfig(k=5, k_policy="fixed", branches=2, sampling=SamplingConfig(0.7)),
        batch=BatchConfig(k_cap="fixed"),
    ).save(path)
    return path


def test_a_profile_gives_typed_settings_by_group(tmp_path: Path) -> None:
    profile = _profile(tmp_path / "p.json")
    seen: list[Tuned] = []
    command = typer.Typer()

    @command.command()
    def run(
        ctx: typer.Context,
        target: str = "x",
        k: int = 8,
        dtype: str = "float32",
        temperature: float = 0.0,
        path: Path | None = None,
    ) -> None:
        seen.append(with_profile(ctx, path, target))

    runner = CliRunner()
    assert runner.invoke(command, []).exit_code == 0 and seen.pop() == Tuned()
    assert runner.invoke(command, ["--path", str(profile)]).exit_code == 0
    tuned = seen.pop()
    assert tuned == Tuned(
        target="tuned-model",
        runtime=RuntimeConfig(backend="transformers", dtype="bfloat16"),
        draft="prompt-lookup",
        k=5,
        k_policy="fixed",
        branches=2,
        temperature=0.7,
    )  # no k_cap: the command has no option of that group
    given = runner.invoke(command, ["--path", str(profile), "--k", "3", "--dtype", "float32", "--target", "other"])
    assert given.exit_code == 0 and "tuned for target 'tuned-model', not 'other'" in " ".join(given.output.split())
    assert seen.pop() == Tuned(temperature=0.7)  # a group's option given: the whole group is the command line's


def test_no_function_of_the_cli_is_over_80_lines() -> None:
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 80, f"{path.name}:{node.lineno} {node.name} has {lines} lines"
