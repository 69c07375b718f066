"""Every build of the native kernels gives the same bits, ARM's included: the bare harness (kernels/harness.cpp, no
torch) is compiled for each x86 build this CPU runs and for aarch64 with SDOT, the latter run under qemu-user, and
their outputs are compared byte for byte."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specdec.models.native import kernel_build

KERNELS = kernel_build.KERNELS
PARTS = [str(KERNELS / name) for name in kernel_build.HARNESS_SOURCES]
COMMON = ["-O2", "-std=c++17", "-ffp-contract=off", f"-I{KERNELS}"]
X86 = [
    name
    for name, (needs, _) in kernel_build.VARIANTS.items()
    if name != "neon" and set(needs) <= kernel_build.cpu_flags()
]
ARM_COMPILER, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")


def _run(tmp_path: Path, name: str, compiler: str, runner: list[str]) -> bytes:
    binary = tmp_path / name
    subprocess.run(
        [
            compiler,
            *COMMON,
            *kernel_build.VARIANTS[name][1],
            *PARTS,
            "-o",
            str(binary),
            *(["-static"] if runner else []),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return subprocess.run([*runner, str(binary)], check=True, capture_output=True, timeout=300).stdout


@pytest.mark.skipif(not X86 or shutil.which("g++") is None, reason="needs g++ and an x86 CPU with AVX2")
def test_every_x86_build_gives_the_same_bits(tmp_path: Path) -> None:
    outputs = {name: _run(tmp_path, name, "g++", []) for name in X86}
    values = np.frombuffer(outputs[X86[0]], dtype=np.float32)
    assert len(values) > 40000 and np.isfinite(values).all() and np.count_nonzero(values) > 0.9 * len(values)
    assert len(set(outputs.values())) == 1, {name: hash(out) for name, out in outputs.items()}
    # at the bounds (harness.cpp's extremes: every int4 weight 15 times activations of 127, AVX2's int16 sums at
    # their largest): w = 15 / 64 - 0.25 on 256 inputs of 1 and of -1 give exactly -4 and 4
    int4 = values[-128:-64]
    assert (int4[:32] == -4.0).all() and (int4[32:] == 4.0).all(), int4


@pytest.mark.skipif(
    ARM_COMPILER is None or QEMU is None or not X86,
    reason="needs Debian's g++-aarch64-linux-gnu and qemu-user (.ci/run installs them) and an x86 build to compare",
)
def test_the_arm_build_runs_under_qemu_with_the_bits_of_x86(tmp_path: Path) -> None:
    x86 = _run(tmp_path, X86[-1], "g++", [])  # the plainest x86 build: AVX2
    arm = _run(tmp_path, "neon", ARM_COMPILER, [QEMU, "-cpu", "max"])
    assert len(arm) == len(x86)
    differ = np.flatnonzero(np.frombuffer(arm, dtype=np.uint32) != np.frombuffer(x86, dtype=np.uint32))
    assert len(differ) == 0, f"{len(differ)} values differ, the first at {differ[:5]}"


def test_the_build_key_follows_the_sources_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A changed source or flag is a new build (its own module and folder), never a stale one reused by name."""
    before = kernel_build.module_name("avx2")
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS, copy)
    monkeypatch.setattr(kernel_build, "KERNELS", copy)
    kernel_build.module_name.cache_clear()
    try:
        assert kernel_build.module_name("avx2") == before  # the same bytes: the same key, wherever they lie
        assert kernel_build.module_name("avx2-vnni") != before
        (copy / "linear.cpp").write_text((copy / "linear.cpp").read_text() + "\n// changed\n")
        kernel_build.module_name.cache_clear()
        assert kernel_build.module_name("avx2") != before
        monkeypatch.setattr(kernel_build, "KERNELS", KERNELS)
        monkeypatch.setattr(kernel_build, "CFLAGS", [*kernel_build.CFLAGS, "-DSOMETHING"])
        kernel_build.module_name.cache_clear()
        assert kernel_build.module_name("avx2") != before
    finally:
        kernel_build.module_name.cache_clear()
