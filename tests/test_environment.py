"""A machine as a new user meets it: a llama.cpp build that crashes, a kernel build killed midway, `specdec doctor`,
and text with brackets printed as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdec.cli.main import app
from specdec.errors import ConfigError
from specdec.models import llamacpp
from specdec.models.native import kernel_build

runner = CliRunner()
STAND_IN = """
import os, signal
__version__ = "0.0-crashing-stand-in"
class Llama:
    def __init__(self, *args, **kwargs):
        pass
    def tokenize(self, text, add_bos=True, special=False):
        return [2, 3, 4, 5]
    def token_eos(self):
        return 1
    def eval(self, tokens):
        os.kill(os.getpid(), signal.SIGSEGV)  # as ggml's AMX kernel does in a -march=native build on some Xeons
"""


@pytest.fixture
def crashing_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A llama_cpp package whose decode dies with SIGSEGV, first on the path of this process and of its children."""
    folder = tmp_path / "stand-in"
    (folder / "llama_cpp").mkdir(parents=True)
    (folder / "llama_cpp" / "__init__.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    llamacpp._probe_verdict.cache_clear()
    llamacpp.build_identity.cache_clear()
    yield folder
    llamacpp._probe_verdict.cache_clear()
    llamacpp.build_identity.cache_clear()


def test_a_crashing_llama_cpp_is_refused_in_one_line_and_the_verdict_is_cached(
    crashing_llama_cpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    problem = llamacpp.llama_cpp_problem()
    assert problem is not None and "SIGSEGV" in problem and "CMAKE_ARGS=" in problem and "-DGGML_NATIVE=OFF" in problem
    assert "\n" not in problem
    (record,) = (tmp_path / "cache" / "probes").glob("llama_cpp-*.json")
    assert json.loads(record.read_text())["problem"] == problem

    llamacpp._probe_verdict.cache_clear()  # a new process: the verdict comes from disk, no second probe
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed again"))
    assert llamacpp.llama_cpp_problem() == problem
    with pytest.raises(ConfigError, match="crashes on this CPU"):
        llamacpp.require_llama_cpp()
    assert "llama_cpp" not in sys.modules  # refused before this process imported it


def test_generate_on_a_crashing_llama_cpp_says_why_and_the_fix(crashing_llama_cpp: Path, tmp_path: Path) -> None:
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path / "cache")}
    command = [
        sys.executable,
        "-m",
        "specdec",
        "generate",
        "def f(x):",
        "--backend",
        "llama.cpp",
        "--max-new-tokens",
        "4",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "SIGSEGV" in lines[0] and "pip install" in lines[0], (
        done.stderr
    )


@pytest.mark.real_model
def test_bench_skips_a_crashing_llama_cpp_and_runs_the_rest(crashing_llama_cpp: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def add(a, b):"}) + "\n")
    backend = "native" if kernel_build.compiled() else "transformers"
    command = [
        sys.executable, "-m", "specdec", "bench", "--prompts", str(prompts), "--methods", "none,llamacpp-greedy",
        "--max-new-tokens", "4", "--backend", backend, "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: llamacpp-greedy skipped: this llama-cpp-python build crashes" in " ".join(done.stderr.split())
    methods = json.loads((tmp_path / "out" / "results.json").read_text())["methods"]
    assert list(methods) == ["none"]


needs_kernels = pytest.mark.skipif(kernel_build.variant() is None, reason="the native kernels need AVX2")


@needs_kernels
def test_a_build_lock_left_by_a_killed_build_is_removed() -> None:
    assert kernel_build.compiled() is not None
    stale = kernel_build.build_folder() / "lock"  # what torch leaves when its build is killed; it would wait forever
    stale.touch()
    start = time.monotonic()
    assert kernel_build.build() is not None
    assert not stale.exists() and time.monotonic() - start < 60


@needs_kernels
def test_waiting_on_a_live_build_times_out_naming_the_folder() -> None:
    folder = kernel_build.build_folder()
    folder.mkdir(parents=True, exist_ok=True)
    holder = textwrap.dedent(
        f"""
        import fcntl, os, sys, time
        guard = open({str(folder / "specdec.lock")!r}, "a+")
        fcntl.flock(guard, fcntl.LOCK_EX)
        guard.seek(0)
        guard.truncate()
        guard.write(str(os.getpid()))
        guard.flush()
        print("held", flush=True)
        time.sleep(60)
        """
    )
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(kernel_build.KernelBuildError, match=f"process {other.pid} has been building") as caught:
            kernel_build.build(wait_s=1)
        assert str(folder) in str(caught.value) and "wait for it" in str(caught.value)
    finally:
        other.kill()
        other.wait()


def test_a_failed_build_shows_the_compilers_own_error() -> None:
    output = (
        "Error building extension 'specdec_cpu_kernels_v10': [1/2] c++ -MMD -MF main.o.d -O3 -c main.cpp -o main.o\n"
        "FAILED: main.o\n"
        "main.cpp:12:5: error: '_mm512_dpbusd_epi32' was not declared in this scope\n"
        "   12 |     _mm512_dpbusd_epi32(acc, a, w);\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    shown = kernel_build.compiler_error(output)
    assert "main.cpp:12:5: error: '_mm512_dpbusd_epi32' was not declared in this scope" in shown
    assert "Error building extension" not in shown
    assert kernel_build.compiler_error("g++: command not found") == "g++: command not found"


def test_doctor_reports_every_part_with_a_status() -> None:
    done = runner.invoke(app, ["doctor", "--json"])
    report = json.loads(done.stdout)
    names = [c["name"] for c in report["checks"]]
    for part in (
        "cpu",
        "torch",
        "native kernels",
        "llama.cpp",
        "model gemma-3-270m",
        "cost cache",
        "extra [ray]",
    ):
        assert part in names, names
    assert {c["status"] for c in report["checks"]} <= {"ok", "missing", "problem"}
    problems = [c for c in report["checks"] if c["status"] == "problem"]
    assert report["problems"] == len(problems) and done.exit_code == (1 if problems else 0)
    assert all(c["detail"] for c in report["checks"])
    text = runner.invoke(app, ["doctor"])
    assert "native kernels" in text.stdout and text.exit_code == done.exit_code


def test_text_with_brackets_prints_as_written(tmp_path: Path) -> None:
    from conftest import char_tokenizer, tiny_llama

    from specdec.cli.generate import DEMO_PROMPT

    tokenizer, folder = char_tokenizer(), tmp_path / "tiny"
    tiny_llama(0, vocab=len(tokenizer), context=1024).save_pretrained(folder)  # room for the demo's prompt
    tokenizer.save_pretrained(folder)
    demo = runner.invoke(app, ["demo", "--target", str(folder), "--max-new-tokens", "6", "--k", "3"])
    assert demo.exit_code == 0, demo.output
    assert "items[j] > items[j + 1]" in demo.stderr and DEMO_PROMPT in demo.stderr
    assert "runtime: transformers" in demo.stderr  # the tiny model's heads are too small for native: auto says so

    weird = "x = a[/] + b[bold] + c[j]"  # rich markup would hide [j] and [bold], and raise on [/]
    missing = "/nonexistent[/]/model[j]"  # shown by the loading spinner, then in the error
    generated = runner.invoke(app, ["generate", weird, "--target", missing, "--max-new-tokens", "2"])
    assert generated.exit_code == 2 and missing in generated.stderr, generated.output
    from specdec.cli.options import console

    with console.capture() as captured:
        console.print(weird)
    assert captured.get().strip() == weird


@pytest.mark.parametrize(
    "returncode, lasting, words",
    [(-9, False, "stopped by SIGKILL"), (1, False, "fails to decode"), (-4, True, "dies with SIGILL"), (0, True, None)],
)
def test_only_a_crash_or_a_clean_run_is_remembered(
    returncode: int, lasting: bool, words: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill from outside (the out-of-memory killer), an error or a time-out may not happen again: the next process
    probes again; a build's own fault (SIGSEGV, SIGILL, ...) or a clean run is kept for this machine and build."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    done = subprocess.CompletedProcess([], returncode, "", "ImportError: a broken build\n" if returncode > 0 else "")
    monkeypatch.setattr(llamacpp.subprocess, "run", lambda *a, **k: done)
    monkeypatch.setattr(llamacpp, "llama_cpp_installed", lambda: True)
    llamacpp._probe_verdict.cache_clear()
    problem = llamacpp._probe_verdict("an-identity")
    llamacpp._probe_verdict.cache_clear()
    assert (problem is None) if words is None else words in problem
    assert (tmp_path / "probes" / "llama_cpp-an-identity.json").exists() == lasting

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired("probe", llamacpp.PROBE_TIMEOUT_S)

    monkeypatch.setattr(llamacpp.subprocess, "run", slow)
    assert "did not decode 12 tokens" in llamacpp._probe_verdict("another")
    llamacpp._probe_verdict.cache_clear()
    assert not (tmp_path / "probes" / "llama_cpp-another.json").exists()


@needs_kernels
def test_generate_on_native_states_its_perplexity_measured_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import char_tokenizer, tiny_llama

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert kernel_build.compiled() is not None  # built and loaded before the cache folder moves
    tokenizer, folder = char_tokenizer(), tmp_path / "tiny"
    tiny_llama(3, vocab=len(tokenizer), hidden=64, context=1024).save_pretrained(folder)  # heads of 16: native runs it
    tokenizer.save_pretrained(folder)
    args = ["generate", "the cat sat on the mat", "--target", str(folder), "--max-new-tokens", "4", "--draft", "none"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert re.search(r"runtime: native \((int8|int4) weights, int8 activations; perplexity ", first.stderr)
    assert "against float32" in first.stderr
    (record,) = (tmp_path / "cache" / "perplexity").glob("native-*.json")
    import specdec.bench.perplexity as measured

    monkeypatch.setattr(measured, "perplexity", lambda *a, **k: pytest.fail("measured again"))
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and first.stderr.splitlines()[:2] == again.stderr.splitlines()[:2]


def test_doctor_reports_a_failing_kernel_build_as_a_problem_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(wait_s: float = 0) -> None:
        raise kernel_build.KernelBuildError("main.cpp:12:5: error: '_mm512_dpbusd_epi32' was not declared")

    monkeypatch.setattr(kernel_build, "variant", lambda: "avx512")
    monkeypatch.setattr(kernel_build, "build", broken)
    done = runner.invoke(app, ["doctor", "--json"])
    report = json.loads(done.stdout)
    (kernels,) = [c for c in report["checks"] if c["name"] == "native kernels"]
    assert kernels["status"] == "problem" and "_mm512_dpbusd_epi32" in kernels["detail"]
    assert done.exit_code == 1 and report["problems"] >= 1


def test_doctor_says_why_a_faster_kernel_build_is_not_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2_only = {"avx2", "fma", "f16c"}
    reasons = kernel_build.faster_builds_not_used("avx2", avx2_only, None)
    assert [r.split(":")[0] for r in reasons] == ["amx", "avx512", "avx2-vnni"]
    assert "lacks avx_vnni" in reasons[2] and "neon" not in " ".join(reasons)
    everything = {*avx2_only, "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"}
    forced = kernel_build.faster_builds_not_used("avx2", everything, "avx2")
    assert len(forced) == 3 and all(f"{kernel_build.FORCE}=avx2 chose avx2" in r for r in forced)
    assert kernel_build.faster_builds_not_used("amx", everything, None) == []
    assert "did not grant" in kernel_build.faster_builds_not_used("amx", everything, None, tiles=False)[0]
    assert kernel_build.faster_builds_not_used("neon", {"asimd", "asimddp"}, None) == []
    monkeypatch.delenv(kernel_build.FORCE, raising=False)  # the build this CPU would choose by itself
    done = runner.invoke(app, ["doctor", "--json"])
    (kernels,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "native kernels"]
    if kernels["status"] == "ok":
        assert f"{kernel_build.variant()} kernels in use" in kernels["detail"]
