"""BENCHMARKS.md is what benchmarks/current_results.py writes from benchmarks/results/: it cannot drift from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_page_is_generated_from_the_results(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "current_results.py"), "--out", str(out)], check=True)
    assert out.read_text() == (ROOT / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md differs from what the results give: run python benchmarks/current_results.py"
    )


def test_the_page_is_the_same_every_time(tmp_path: Path) -> None:
    pages = []
    for name in ("first.md", "second.md"):
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "current_results.py"), "--out", str(tmp_path / name)], check=True
        )
        pages.append((tmp_path / name).read_text())
    assert pages[0] == pages[1]
    assert "benchmarks/journal/notebook.md" in pages[0]
