"""The GPU self-check's CPU path runs end to end (small settings), so the script is ready the day a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
@pytest.mark.real_model
def test_gpu_check_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert {name.split(",")[0] for name in checks} >= {
        "greedy identity",
        "chi-square",
        "draft on the host",
        "batched",
        "server batcher",
        "batched throughput",
    }
    assert all(check["ok"] for check in checks.values())
    for plan in ("fp32", "bf16", "fp8-draft"):
        figures = checks[f"greedy identity, {plan}"]["figures"]
        assert {"prompt-lookup", "lookup-then-draft", "layerskip:9", "ngram (prompt set)"} <= set(figures)
        assert all(f["identical"] == 1.0 for name, f in figures.items() if isinstance(f, dict))


def test_gpu_check_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "--device cpu" in run.stderr and "Traceback" not in run.stderr
