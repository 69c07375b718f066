"""A machine as a new user meets it: a llama.cpp build that crashes, a kernel build killed midway, `specdec doctor`,
and text with brackets printed as written."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.utils import cpp_extension
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
        "--runtime",
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


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_skips_a_crashing_llama_cpp_and_runs_the_rest(crashing_llama_cpp: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def add(a, b):"}) + "\n")
    backend = "native" if kernel_build.compiled() else "transformers"
    command = [
        sys.executable, "-m", "specdec", "bench", "--prompts", str(prompts), "--methods", "none,llamacpp-greedy",
        "--max-new-tokens", "4", "--runtime", backend, "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: llamacpp-greedy skipped: this llama-cpp-python build crashes" in " ".join(done.stderr.split())
    methods = json.loads((tmp_path / "out" / "results.json").read_text())["methods"]
    assert list(methods) == ["none"]


needs_kernels = pytest.mark.skipif(kernel_build.variant() is None, reason="the native kernels need AVX2")


@pytest.fixture
def fake_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """A kernels' cache of its own, with torch's compile-and-import step faked as torch and ninja behave (a library
    already in the folder is up to date and imported as it is; otherwise one of known bytes is "compiled"): the
    variants built and the bytes of every library imported are recorded. Nothing is compiled."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(kernel_build.FORCE, raising=False)
    seen = SimpleNamespace(compiled=[], imported=[])

    def load(name, sources, extra_cflags, extra_include_paths, extra_ldflags, build_directory):
        library = Path(build_directory) / f"{name}.so"
        assert not (Path(build_directory) / "lock").exists(), "torch would wait on its lock file forever"
        if not library.exists():
            seen.compiled.append(name)
            library.write_bytes(f"compiled {name}".encode())
        return imported(name, library)

    def imported(name: str, library: Path) -> SimpleNamespace:
        seen.imported.append(library.read_bytes())
        return SimpleNamespace(__name__=name, tiles_in_use=lambda: True)

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(kernel_build, "_import", imported)
    kernel_build.selected.cache_clear()
    yield seen
    kernel_build.selected.cache_clear()


def test_a_build_lock_left_by_a_killed_build_is_removed(fake_compiler: SimpleNamespace) -> None:
    folder = kernel_build.build_folder("avx2")
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what torch leaves when its build is killed; it would wait on it forever
    assert kernel_build.build(name="avx2") is not None
    assert fake_compiler.compiled == [kernel_build.module_name("avx2")]


def test_waiting_on_a_live_build_times_out_naming_the_folder(fake_compiler: SimpleNamespace) -> None:
    folder = kernel_build.build_folder("avx2")
    folder.mkdir(parents=True, mode=0o700)
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
            kernel_build.build(wait_s=1, name="avx2")
        assert str(folder) in str(caught.value) and "wait for it" in str(caught.value)
    finally:
        other.kill()
        other.wait()


def test_a_library_planted_in_a_build_folder_is_not_imported_but_rebuilt(
    fake_compiler: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """The folders are made private (0700); a library whose SHA-256 is not the one recorded when it was built (the
    compiler's output, unlike a planted one, is always newer than the sources) is never imported: it is rebuilt from
    the sources, saying so; the rebuilt one then loads as it is."""
    kernel_build.build(name="avx2")
    folder, name = kernel_build.build_folder("avx2"), kernel_build.module_name("avx2")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    library = folder / f"{name}.so"
    built = library.read_bytes()
    library.write_bytes(b"planted: its init code would run as whoever loads the kernels next")
    with caplog.at_level(logging.WARNING, logger="specdec"):
        kernel_build.build(name="avx2")
    assert all(b"planted" not in imported for imported in fake_compiler.imported)
    assert fake_compiler.compiled == [name, name] and library.read_bytes() == built
    assert f"{library} does not match the SHA-256 recorded" in caplog.text
    kernel_build.build(name="avx2")  # verified: imported, not compiled again
    assert fake_compiler.compiled == [name, name] and fake_compiler.imported[-1] == built


@pytest.mark.parametrize("unsafe", ["group-writable kernels folder", "others-writable build", "foreign-owned build"])
def test_a_kernel_folder_another_user_could_write_is_refused_in_one_line(
    unsafe: str, fake_compiler: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_build.build(name="avx2")
    folder = kernel_build.build_folder("avx2")
    refused, owner = (folder.parent if unsafe.startswith("group") else folder), 4242
    if unsafe.startswith("group"):
        folder.parent.chmod(0o770)
    elif unsafe.startswith("others"):
        folder.chmod(0o702)
    elif os.geteuid() == 0:  # root trusts only its own folders: give it to another user
        os.chown(folder, owner, owner)
    else:  # a user cannot give a folder away: be another one
        owner = os.getuid()
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    loads = len(fake_compiler.imported)
    with pytest.raises(ConfigError) as caught:
        kernel_build.build(name="avx2")
    message = str(caught.value)
    assert "\n" not in message and str(refused) in message and "SPECDEC_CACHE" in message, message
    assert ("writable by group or others" if "writable" in unsafe else f"belongs to user {owner}") in message
    assert len(fake_compiler.imported) == loads  # nothing of it was imported


def test_a_folder_above_the_kernels_that_others_could_write_is_refused(fake_compiler: SimpleNamespace) -> None:
    """Another user who can write a folder higher up could rename a folder of their own into the kernels' place after
    the check; one with the sticky bit (as /tmp) lets no one rename what is not theirs."""
    kernel_build.build(name="avx2")
    above = kernel_build.build_folder("avx2").parent.parent  # the cache's root
    loads = len(fake_compiler.imported)
    try:
        above.chmod(0o777)
        with pytest.raises(ConfigError) as caught:
            kernel_build.build(name="avx2")
        message = str(caught.value)
        assert "\n" not in message and f"{above.resolve()} is writable by group or others" in message, message
        assert len(fake_compiler.imported) == loads
        above.chmod(0o777 | stat.S_ISVTX)
        kernel_build.build(name="avx2")
        assert len(fake_compiler.imported) == loads + 1
    finally:
        above.chmod(0o700)


def test_a_read_only_kernel_cache_loads_its_verified_build_without_the_lock(fake_compiler: SimpleNamespace) -> None:
    """As root a chmod does not stop writes, so what proves the cache was only read is that no lock file was created;
    a lock that cannot be opened (a folder in its place, unopenable even for root) stands for a read-only cache that
    holds no verified build: one line, naming SPECDEC_CACHE."""
    kernel_build.build(name="avx2")
    folder, name = kernel_build.build_folder("avx2"), kernel_build.module_name("avx2")
    (folder / "specdec.lock").unlink()
    folder.chmod(0o500)
    try:
        assert kernel_build.build(name="avx2").__name__ == name
        assert not (folder / "specdec.lock").exists() and fake_compiler.compiled == [name]
    finally:
        folder.chmod(0o700)
    (folder / "specdec.lock").mkdir()
    (folder / f"{name}.so").write_bytes(b"not the library recorded")
    with pytest.raises(kernel_build.KernelBuildError) as caught:
        kernel_build.build(name="avx2")
    assert "\n" not in str(caught.value) and "holds no verified build" in str(caught.value)
    assert "SPECDEC_CACHE" in str(caught.value) and fake_compiler.compiled == [name]


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
def test_generate_on_native_states_the_perplexity_doctor_measured_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `generate` says of the native runtime measures nothing: it names `doctor --target`, which measures the
    perplexity against float32 once and stores it; `generate` then states the stored figure."""
    from conftest import char_tokenizer, tiny_llama

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert kernel_build.compiled() is not None  # built and loaded before the cache folder moves
    tokenizer, folder = char_tokenizer(), tmp_path / "tiny"
    tiny_llama(3, vocab=len(tokenizer), hidden=64, context=1024).save_pretrained(folder)  # heads of 16: native runs it
    tokenizer.save_pretrained(folder)
    args = ["generate", "the cat sat on the mat", "--target", str(folder), "--max-new-tokens", "4", "--draft", "none"]
    import specdec.bench.perplexity as measured

    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    said_format = (
        r"runtime: native \((int8|int4) weights, int8 activations, [a-z0-9-]+( \(no tiles\))? kernels; perplexity"
    )
    assert re.search(said_format + " not measured", first.stderr)
    assert f"specdec doctor --target {folder}" in " ".join(first.stderr.split())
    assert not (tmp_path / "cache" / "perplexity").exists()
    checked = runner.invoke(app, ["doctor", "--json", "--target", str(folder)])
    (check,) = [c for c in json.loads(checked.stdout)["checks"] if c["name"].startswith("native perplexity")]
    assert check["status"] == "ok" and "against float32" in check["detail"], check
    (record,) = (tmp_path / "cache" / "perplexity").glob("native-*.json")
    monkeypatch.setattr(measured, "perplexity", lambda *a, **k: pytest.fail("measured again"))
    said = runner.invoke(app, args)
    assert said.exit_code == 0, said.output
    assert re.search(said_format + r" [0-9.]+ against float32 ", said.stderr)
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and said.stderr.splitlines()[:2] == again.stderr.splitlines()[:2]
    assert runner.invoke(app, ["doctor", "--json", "--target", str(folder)]).exit_code in (0, 1)  # read, not measured


def test_doctor_reports_a_failing_kernel_build_as_a_problem_with_its_error(
    fake_compiler: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(wait_s: float = 0, name: str | None = None) -> None:
        raise kernel_build.KernelBuildError("main.cpp:12:5: error: '_mm512_dpbusd_epi32' was not declared")

    monkeypatch.setattr(kernel_build, "variant", lambda: "avx512")
    monkeypatch.setattr(kernel_build, "build", broken)
    done = runner.invoke(app, ["doctor", "--json"])
    report = json.loads(done.stdout)
    (kernels,) = [c for c in report["checks"] if c["name"] == "native kernels"]
    assert kernels["status"] == "problem" and "_mm512_dpbusd_epi32" in kernels["detail"]
    assert done.exit_code == 1 and report["problems"] >= 1


def test_doctor_names_the_build_the_runtime_loads_when_a_faster_one_fails(
    fake_compiler: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec import machine

    flags = frozenset({"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni"})  # no AMX
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    compile_ = cpp_extension.load

    def no_avx512(name: str, **kwargs):
        if name.startswith("specdec_kernels_avx512_"):
            raise RuntimeError("Error building extension\nlinear.cpp:3:1: error: this compiler has no AVX-512")
        return compile_(name, **kwargs)

    monkeypatch.setattr(cpp_extension, "load", no_avx512)
    done = runner.invoke(app, ["doctor", "--json"])
    (kernels,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "native kernels"]
    assert kernels["status"] == "ok", kernels
    assert "avx2-vnni kernels in use" in kernels["detail"] and "this compiler has no AVX-512" in kernels["detail"]
    assert str(kernel_build.build_folder("avx2-vnni")) in kernels["detail"]
    assert kernel_build.build_name() == kernel_build.module_name("avx2-vnni")  # what the runtime loads


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
