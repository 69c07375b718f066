"""`specdec bench` end to end on a tiny model folder: outputs, the greedy check, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specdec.bench.report import PLOTS
from specdec.cli.main import app
from specdec.verification import Verdict

runner = CliRunner()

SUMMARY_KEYS = {
    "draft_ms_p50",
    "draft_ms_p99",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "new_tokens",
    "acceptance_rate",
    "mean_accepted_per_step",
    "tokens_per_step",
    "target_forwards_per_token",
    "ttft_s",
    "draft_s_per_token",
    "verify_s_per_step",
    "mean_proposed_per_step",
    "speedup_vs_none",
    "speedup_vs_own_greedy",
    "predicted_speedup",
    "predicted_speedup_measured_costs",
    "identical_share",
}


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "a", "category": "code", "prompt": "abc abc abc abc"},
        {"id": "b", "category": "chat", "prompt": "hello there, hello there"},
        {"id": "c", "category": "chat", "prompt": "unused in quick mode"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _bench(tiny_folder: Path, prompts: Path, out: Path, *extra: str):
    args = ["bench", "--target", str(tiny_folder), "--prompts", str(prompts), "--out", str(out), "--quick"]
    return runner.invoke(app, args + list(extra))


def test_quick_bench_writes_every_output(
    tiny_folder: Path, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # the cost-model policy measures and caches costs
    out = tmp_path / "out"
    methods = f"none,prompt-lookup,oracle,model:{tiny_folder},layerskip:1,hf-greedy,hf-prompt-lookup,llamacpp-greedy"
    result = _bench(
        tiny_folder,
        prompts,
        out,
        "--methods",
        methods,
        "--k",
        "2,4",
        "--k-policy",
        "fixed,cost-model",
        "--repeats",
        "2",
        "--strict",
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    assert set(data) == {
        "config",
        "machine",
        "categories",
        "methods",
        "greedy_mismatches",
        "greedy_identical_share",
        "notes",
        "target_forward_cost_ms",
        "positions",
    }
    assert list(data["target_forward_cost_ms"]) == ["1", "2", "3", "5", "9", "13", "17"]
    assert all(ms > 0 for ms in data["target_forward_cost_ms"].values())
    assert data["categories"] == ["overall", "chat", "code"]
    assert set(data["machine"]) >= {"device", "cpu", "cores", "torch", "dtype"}
    assert {
        "none",
        "prompt-lookup@k2",
        "prompt-lookup@k4",
        "prompt-lookup@cost-model-k4",
        "layerskip:1@k2",
        "oracle@k4",
        "hf-greedy",
        "hf-prompt-lookup@k2",
    } <= set(data["methods"])
    assert "hf-prompt-lookup@cost-model-k2" not in data["methods"]  # peers keep their own k schedule
    lookup = data["methods"]["prompt-lookup@cost-model-k4"]
    assert lookup["k_policy"] == "cost-model" and set(map(int, lookup["k_histogram"])) <= set(range(5))
    assert data["methods"]["layerskip:1@k2"]["categories"]["overall"]["draft_ms_p99"] > 0
    for method in data["methods"].values():
        assert set(method) >= {
            "family",
            "k",
            "peak_memory_mb",
            "peak_memory_increase_vs_none_mb",
            "peak_memory_increase_vs_none",
            "accepted_per_step_histogram",
        }
        assert method["peak_memory_mb"] > 100  # the whole process, target included
        for row in method["categories"].values():
            assert set(row) == SUMMARY_KEYS
    assert data["greedy_mismatches"] == []
    assert all(share == 1.0 for share in data["greedy_identical_share"].values())
    oracle = data["methods"]["oracle@k4"]["categories"]["overall"]
    assert oracle["acceptance_rate"] == 1.0
    assert data["methods"]["hf-prompt-lookup@k4"]["categories"]["overall"]["speedup_vs_own_greedy"] > 0
    assert data["methods"]["hf-greedy"]["categories"]["overall"]["ttft_s"] > 0
    report = (out / "report.md").read_text()
    assert "## code" in report and "Hardware row" in report and "k histogram" in report
    for plot in PLOTS:
        assert (out / plot).stat().st_size > 1000
    assert "llamacpp-greedy skipped" in data["notes"][0]  # not installed, or (here) the target is no GGUF file


def test_greedy_check_catches_a_broken_engine(
    tiny_folder: Path, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specdec.verification.verifiers as verifiers

    real_verify = verifiers.verify_greedy

    def accept_everything(draft_tokens, draft_lengths, argmax) -> Verdict:
        verdict = real_verify(draft_tokens, draft_lengths, argmax)
        rows = torch.arange(draft_tokens.shape[0])
        return Verdict(draft_lengths, argmax[rows, draft_lengths] if draft_tokens.shape[1] else verdict.next_token)

    monkeypatch.setattr(verifiers, "verify_greedy", accept_everything)
    loose = _bench(tiny_folder, prompts, tmp_path / "loose", "--methods", "none,prompt-lookup")
    assert loose.exit_code == 0, loose.output
    data = json.loads((tmp_path / "loose" / "results.json").read_text())
    assert any(m["method"] == "prompt-lookup@k4" for m in data["greedy_mismatches"])
    strict = _bench(tiny_folder, prompts, tmp_path / "strict", "--methods", "none,prompt-lookup", "--strict")
    assert strict.exit_code == 1 and "differ from target-only" in strict.output


@pytest.mark.parametrize(
    "content, words",
    [
        ("", "has no prompts"),
        ('{"id": "a", "category": "code", "prompt": "x"}\nnot json\n', ":2 is not valid JSON"),
        ('{"id": "a", "category": "code"}\n', ":1 lacks a non-empty string for prompt"),
        ("[1, 2]\n", ":1 is not a JSON object"),
        (
            '{"id": "a", "category": "c", "prompt": "x"}\n{"id": "a", "category": "c", "prompt": "y"}\n',
            "repeats the id",
        ),
    ],
)
def test_bad_prompt_files(content: str, words: str, tiny_folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    result = _bench(tiny_folder, path, tmp_path / "out")
    assert result.exit_code == 2 and words in result.output
    assert "Traceback" not in result.output


def test_bench_argument_errors(tiny_folder: Path, prompts: Path, tmp_path: Path) -> None:
    missing = _bench(tiny_folder, tmp_path / "nope.jsonl", tmp_path / "o1")
    assert missing.exit_code == 2 and "does not exist" in missing.output
    unknown = _bench(tiny_folder, prompts, tmp_path / "o2", "--methods", "none,warp-drive")
    assert unknown.exit_code == 2 and "unknown method 'warp-drive'" in unknown.output
    existing = tmp_path / "exists"
    existing.mkdir()
    refused = _bench(tiny_folder, prompts, existing)
    assert refused.exit_code == 2 and "--overwrite" in refused.output
    bad_k = _bench(tiny_folder, prompts, tmp_path / "o3", "--k", "2,x")
    assert bad_k.exit_code == 2 and "--k" in bad_k.output


def test_bench_runs_a_precision_plan(tiny_folder: Path, prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    result = _bench(
        tiny_folder, prompts, out, "--precision", "cpu", "--methods", "none,prompt-lookup,hf-greedy", "--strict"
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["dtype"] == "attention=bfloat16,ffn=int8,head=bfloat16,draft=bfloat16,verify=float32"
    assert results["greedy_identical_share"]["prompt-lookup@k4"] == 1.0  # the same plan's target-only output
    refused = _bench(tiny_folder, prompts, tmp_path / "p2", "--precision", "cpu", "--runtime", "llama.cpp")
    assert refused.exit_code == 2 and "GGUF" in refused.output


def test_a_bench_in_a_log_says_where_it_is_and_sampled_identity_is_na(
    tiny_folder: Path, prompts: Path, tmp_path: Path
) -> None:
    """Without a terminal (a CI log, a pipe) each finished unit prints a line with an ETA; sampled identity is n/a."""
    result = _bench(tiny_folder, prompts, tmp_path / "out", "--methods", "none,prompt-lookup", "--temperature", "0.8")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if " done: " in line]
    assert (
        len(lines) == 4
        and lines[0].startswith("1/4 done: ")
        and lines[-1].startswith("4/4 done: ")
        and "s left)" in lines[0]
    )
    assert all(
        row.rstrip(" │").endswith("n/a")
        for row in result.output.splitlines()
        if row.startswith(("│ none", "│ prompt-lookup"))
    )
    assert "| n/a |" in (tmp_path / "out" / "report.md").read_text()


def test_prompt_sets_ship_in_the_package_and_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' default set resolves inside the package from any folder; a name or a path both work; `specdec
    prompts` lists every set with its size and categories; anything else names the sets and the fix."""
    from specdec.bench.prompts import DEFAULT_PROMPTS, SETS_FOLDER, load_prompts, prompt_sets
    from specdec.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # nowhere near the repository
    assert {"default", "core", "mixed"} <= set(prompt_sets())
    assert all(path.is_relative_to(SETS_FOLDER) for path in prompt_sets().values())
    default = load_prompts(DEFAULT_PROMPTS)
    assert len(default) == 44 and {p.category for p in default} == {"code", "context-reuse", "chat", "open-writing"}
    assert load_prompts("core") == load_prompts(prompt_sets()["core"])
    with pytest.raises(ConfigError, match="does not exist: it is neither a prompt set .*default.*nor a file"):
        load_prompts("no-such-set")
    listing = runner.invoke(app, ["prompts"])
    assert listing.exit_code == 0, listing.output
    assert "default" in listing.output and "44" in listing.output and "mixed" in listing.output


def test_the_old_drafter_name_still_works_with_a_deprecation_warning(tiny_folder: Path) -> None:
    from specdec.drafters import build_drafter
    from specdec.errors import ConfigError
    from specdec.models import open_target

    target = open_target(str(tiny_folder))
    with pytest.warns(FutureWarning, match="now called 'lookup-then-draft'"):
        # the same drafter: none ships for a tiny model
        with pytest.raises(ConfigError, match="no draft ships with specdec for"):
            build_drafter("default", target)
    with pytest.raises(ConfigError, match="no draft ships with specdec for"):
        build_drafter("lookup-then-draft", target)


def test_a_bench_of_the_suffix_drafter_reports_the_curve_and_refuses_repeats(tiny_folder: Path, tmp_path: Path) -> None:
    """Prompts that repeat across the run: suffix's later prompts draft from earlier answers (the curve rises), output
    identical; a repeat would copy the first pass, so --repeats > 1 is refused for it."""
    path = tmp_path / "repeating.jsonl"
    rows = [{"id": str(i), "category": "c", "prompt": "q: tell me a story. a:"} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    args = ["bench", "--target", str(tiny_folder), "--prompts", str(path), "--out", str(out)]
    result = runner.invoke(app, args + ["--methods", "none,prompt-lookup,suffix", "--max-new-tokens", "24", "--strict"])
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    curve = results["positions"]["suffix@k4"]
    assert [p["positions"] for p in curve] == ["1-3", "4-6"]
    assert curve[1]["tokens_per_step"] > results["positions"]["prompt-lookup@k4"][1]["tokens_per_step"]
    assert "Along the run" in (out / "report.md").read_text()
    refused = runner.invoke(app, args + ["--methods", "none,suffix", "--repeats", "2", "--overwrite"])
    assert refused.exit_code == 2 and "--repeats 1" in refused.output
