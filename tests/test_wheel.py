"""specdec as a user installs it: a wheel (not editable, not a clone) in a fresh virtual environment, run from an
empty folder. Everything it needs at run time (draft weights, prompt sets) must come from the package."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # generate, bench and serve run the bundled Gemma-3-270M


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh venv holding only the built wheel; its dependencies come from the environment running
    the tests (its site-packages on the path, after the venv's own: no second download of torch and the models), whether
    that is a virtual environment or not. That folder's .pth files are not run: an editable specdec there is ignored."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"  # a copy, so that building leaves no build/ or egg-info in the checkout
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "results", ".venv"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(base / "dist"),
        ],
        check=True,
    )
    (wheel,) = (base / "dist").glob("specdec-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"]) / "test-env.pth").write_text(
        "\n".join(ours) + "\n"
    )
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    return venv / "bin"


def run(bin_folder: Path, folder: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        [str(bin_folder / args[0]), *args[1:]], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_wheel_runs_every_command_from_an_empty_folder(installed: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    where = run(installed, empty, "python", "-c", "import specdec; print(specdec.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(installed.parent), where  # the wheel's copy, not this checkout's

    models = run(installed, empty, "specdec", "models")
    assert models.returncode == 0 and "gemma-3-270m" in models.stdout, models.stderr
    prompts = run(installed, empty, "specdec", "prompts")
    assert prompts.returncode == 0 and "default" in prompts.stdout and "44" in prompts.stdout, prompts.stderr

    generated = run(installed, empty, "specdec", "generate", "def add(a, b):", "--max-new-tokens", "6", "--json")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["stats"]["new_tokens"] == 6

    bench = run(
        installed,
        empty,
        "specdec",
        "bench",
        "--prompts",
        "core",
        "--methods",
        "none,prompt-lookup",
        "--quick",
        "--out",
        "out",
    )
    assert bench.returncode == 0, bench.stderr
    results = json.loads((empty / "out" / "results.json").read_text())
    methods = results["methods"]
    assert "none" in methods and any(m.startswith("prompt-lookup") for m in methods), methods.keys()
    assert results["config"]["prompt_count"] == 2  # --quick: two of the core set's prompts

    port = _free_port()
    env = {**os.environ, "PATH": f"{installed}{os.pathsep}{os.environ['PATH']}"}
    server = subprocess.Popen(
        [str(installed / "specdec"), "serve", "--port", str(port)],
        cwd=empty,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": model, "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 6
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    assert not any(empty.glob("benchmarks")), "nothing of the repository layout is needed, or created"
