"""Building and loading the native CPU kernels (the C++ sources in ``kernels/``), and calling them.

One set of sources is compiled on first use with torch's cpp_extension (g++ and ninja, under a minute, then cached in
``build_folder()``) for the best of ``VARIANTS`` this CPU runs: AVX-512 with AMX (tile products for 2 positions or
more), AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2, or ARM NEON with SDOT; all give the same bits. A build's folder and
module are named by a hash of the sources and the compiler flags, so a changed source is a new build, never a stale
one. Where none can be built (no AVX2 or SDOT, no compiler), ``linear`` gives the same numbers from each format's
float64 reference (exact, only slower) and the other kernels are unavailable (the native backend says so).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from specdec.machine import cpu_flags

log = logging.getLogger("specdec")
KERNELS = Path(__file__).parent / "kernels"
KERNEL_SOURCES = ("linear.cpp", "attention.cpp", "elementwise.cpp")  # the kernels, without torch
SOURCES = (*KERNEL_SOURCES, "bindings.cpp")  # compiled into the extension
HARNESS_SOURCES = ("harness.cpp", *KERNEL_SOURCES)  # the bare program the tests run on every build (no torch)
HEADERS = tuple(sorted(p.name for p in KERNELS.glob("*.h")))
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-DSPECDEC_TORCH"]  # every build's, before its instruction sets'


NON_FINITE = (
    "a native layer got NaN or infinite activations (the model's numbers overflowed on this input, or its weights are "
    "damaged): the native format cannot represent them; try --backend transformers"
)


def on_cpu(*tensors: torch.Tensor) -> None:
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(
            "the native kernels compute on the CPU: pass CPU tensors (elsewhere use --backend transformers)"
        )


def call(function, *args):
    """A kernel call whose own checks (shapes, types, finite activations) fail as a ValueError naming the problem."""
    try:
        return function(*args)
    except RuntimeError as exc:  # a failed TORCH_CHECK: its message is the first line
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise ValueError(NON_FINITE if "NaN or infinite" in message else f"native kernel: {message}") from None


def vnni_available() -> bool:
    """Whether this CPU has AVX-512 VNNI (which the AVX-512 and AMX builds need)."""
    return "avx512_vnni" in cpu_flags()


# The kernels' builds, fastest first: the CPU flags each needs and the compiler's. One set of sources; the same bits
# on each.
VARIANTS = {
    "amx": (
        ("avx512f", "avx512bw", "avx512_vnni", "f16c", "amx_tile", "amx_int8"),
        ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c", "-mamx-tile", "-mamx-int8"],
    ),
    "avx512": (("avx512f", "avx512bw", "avx512_vnni", "f16c"), ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c"]),
    "avx2-vnni": (("avx2", "fma", "f16c", "avx_vnni"), ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    "neon": (("asimd", "asimddp"), ["-march=armv8.2-a+dotprod"]),  # ARM with SDOT (compiled for, not run, here)
}
FORCE = "SPECDEC_KERNELS"  # environment variable: a variant to build instead of the fastest this CPU runs


def variant() -> str | None:
    """The kernels' build for this CPU: $SPECDEC_KERNELS if set (and the CPU runs it), else the fastest it runs."""
    flags = cpu_flags()
    forced = os.environ.get(FORCE)
    if forced:
        if forced not in VARIANTS or not set(VARIANTS[forced][0]) <= flags:
            runs = [name for name, (needs, _) in VARIANTS.items() if set(needs) <= flags]
            log.warning(
                "%s=%s is not a kernel build this CPU runs (%s): ignored", FORCE, forced, ", ".join(runs) or "none"
            )
        else:
            return forced
    return next((name for name, (needs, _) in VARIANTS.items() if set(needs) <= flags), None)


@functools.cache
def module_name(name: str) -> str:
    """The extension module of a build: its variant and a hash of the sources and flags (the build's key)."""
    digest = hashlib.sha256()
    for file in (*SOURCES, *HEADERS):
        digest.update(file.encode() + b"\0" + (KERNELS / file).read_bytes() + b"\0")
    digest.update(" ".join(CFLAGS + VARIANTS[name][1]).encode())
    return f"specdec_kernels_{name.replace('-', '_')}_{digest.hexdigest()[:16]}"


BUILD_WAIT_S = 600  # longest wait for another process's build of the kernels


def faster_builds_not_used(used: str, flags: set[str], forced: str | None, tiles: bool = True) -> list[str]:
    """Why each build faster than ``used`` for this CPU's family (x86 or ARM) is not in use, one line each: the CPU
    lacks its instructions, $SPECDEC_KERNELS chose another, or (AMX) Linux did not grant the tiles' state."""
    arm = used == "neon"
    reasons = []
    for name, (needs, _) in VARIANTS.items():
        if name == used:
            break
        if (name == "neon") != arm:
            continue
        if missing := sorted(set(needs) - flags):
            reasons.append(f"{name}: this CPU lacks {', '.join(missing)}")
        elif forced:
            reasons.append(f"{name}: {FORCE}={forced} chose {used} (unset it to use {name})")
        else:
            reasons.append(f"{name}: its build failed here (the warning above says why; {FORCE}={name} retries it)")
    if used == "amx" and not tiles:
        reasons.append("amx tiles: Linux did not grant their state (5.16+ needed), so its int8 products run on VNNI")
    return reasons


class KernelBuildError(RuntimeError):
    """The kernels could not be built here; the message names the cause (the compiler's own error) and the fix."""


def build_folder(name: str | None = None) -> Path:
    """Where a build of the kernels is compiled and cached: one folder per build key (sources, flags), torch and
    Python."""
    from specdec.models.registry import cache_root

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return (
        cache_root()
        / "kernels"
        / f"{module_name(name or variant() or 'avx512')}-torch{torch.__version__.split('+')[0]}-{python}"
    )


def is_built(name: str | None = None) -> bool:
    name = name or variant() or "avx512"
    return (build_folder(name) / f"{module_name(name)}.so").exists()


def compiled():
    """The compiled kernels, or None (``linear`` then takes its exact float64 path) where this machine cannot run or
    build them."""
    return _load()[0]


def build_name() -> str:
    """The kernels' build in use (its module's name: variant and build key, and whether the AMX build's tiles run),
    or the float64 reference where none runs."""
    module = compiled()
    if module is None:
        return "float64 reference"
    amx = module.__name__.startswith(module_name("amx").rsplit("_", 1)[0] + "_")
    return module.__name__ + ("" if not amx or module.tiles_in_use() else " (no tiles)")


def kernels_problem() -> str | None:
    """Why the kernels are not available here (no AVX2 or ARM SDOT, or the build's error), or None."""
    return _load()[1]


@functools.cache
def _load():
    first = variant()
    if first is None:
        return None, "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM)"
    runs = [name for name, (needs, _) in VARIANTS.items() if set(needs) <= cpu_flags()]
    failures = []
    for name in [first] + runs[runs.index(first) + 1 :]:  # a build the compiler refuses gives way to a plainer one
        try:
            return build(name=name), None
        except KernelBuildError as exc:  # unwritable cache, no compiler, a compile error
            failures.append(f"{name}: {exc}")
            log.warning("specdec's %s kernels could not be built (%s): trying a plainer build", name, exc)
    log.warning(
        "specdec's CPU kernels are not available, so native layers use their exact float64 reference: %s", failures[0]
    )
    return None, f"the kernels' build failed: {'; '.join(failures)}"


def build(wait_s: float = BUILD_WAIT_S, name: str | None = None):
    """Compile (first use: under a minute, said on stderr) or load a build of the kernels (``name``: a key of
    ``VARIANTS``; by default this CPU's), one process at a time.

    torch marks a build in progress with a ``lock`` file and waits, without limit, while it exists; a build killed
    midway leaves it behind. Builds here also hold an OS lock on ``specdec.lock``, which dies with its process: holding
    it, any ``lock`` file left is stale and removed; a live build is waited for at most ``wait_s`` seconds.
    """
    from torch.utils.cpp_extension import load

    name = name or variant()
    if name is None:
        raise KernelBuildError(
            "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM): the native kernels cannot run here"
        )
    folder = build_folder(name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        guard = open(folder / "specdec.lock", "a+")
    except OSError as exc:
        raise KernelBuildError(f"the kernels' folder {folder} is not writable ({exc}): set SPECDEC_CACHE") from None
    with guard:
        if _hold(guard, folder, wait_s):
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was stopped midway", stale)
                stale.unlink()
        if not is_built(name):
            log.warning(
                "compiling specdec's CPU kernels (%s) for this machine, once (under a minute; cached in %s)",
                name,
                folder,
            )
        try:
            return load(
                module_name(name),
                sources=[str(KERNELS / file) for file in SOURCES],
                extra_cflags=[*CFLAGS, *VARIANTS[name][1]],
                extra_include_paths=[str(KERNELS)],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
        except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, a compile error
            raise KernelBuildError(compiler_error(str(exc))) from None


def _hold(guard, folder: Path, wait_s: float) -> bool:
    """Take the build's OS lock (and write this process's id in its file), waiting at most ``wait_s`` seconds for the
    process that holds it; False where this system has no such locks (torch's own lock file is then all there is)."""
    try:
        import fcntl
    except ImportError:
        return False
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            guard.seek(0)
            guard.truncate()
            guard.write(str(os.getpid()))
            guard.flush()
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                guard.seek(0)
                holder = guard.read().strip() or "another process"
                raise KernelBuildError(
                    f"process {holder} has been building the kernels in {folder} for over {wait_s:.0f} s: wait for it, "
                    f"or stop it and run again"
                ) from None
            if not waiting:
                log.warning("waiting for another process to finish building specdec's CPU kernels in %s", folder)
                waiting = True
            time.sleep(0.2)


def compiler_error(message: str, lines: int = 12) -> str:
    """The informative part of a failed build's output: the compiler's error lines (else its last lines), one string."""
    text = [line.rstrip() for line in message.splitlines() if line.strip()]
    errors = [line for line in text if "error" in line.lower() and not line.startswith("Error building extension")]
    shown = (errors or text[-lines:])[:lines]
    return " | ".join(shown) if shown else message
