"""Building and loading the native CPU kernels (the C++ sources in ``kernels/``), and calling them.

One set of sources is compiled on first use with torch's cpp_extension (g++ and ninja, under a minute, then cached in
``build_folder()``) for the best of ``VARIANTS`` this CPU runs: AVX-512 with AMX (tile products for 2 positions or
more), AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2, or ARM NEON with SDOT; all give the same bits. A build's folder and
module are named by a hash of the sources and the compiler flags, so a changed source is a new build, never a stale
one. Where none can be built (no AVX2 or SDOT, no compiler), ``linear`` gives the same numbers from each format's
float64 reference (exact, only slower) and the other kernels are unavailable (the native backend says so).

A library is imported only where this process built it or verified it: the folders are private (made 0700; one another
user owns or could write is refused), and the library's SHA-256, recorded when it is built, is checked before every
import (a library that does not match is rebuilt). A verified build loads without the lock, so a read-only cache works.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from specdec.atomic import atomic_write_bytes
from specdec.errors import ConfigError
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
    "damaged): the native format cannot represent them; try --runtime transformers"
)


def on_cpu(*tensors: torch.Tensor) -> None:
    if not all(t.is_cpu for t in tensors):
        raise ValueError(
            "the native kernels compute on the CPU: pass CPU tensors (elsewhere use --runtime transformers)"
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


def faster_builds_not_used(
    used: str, flags: set[str], forced: str | None, tiles: bool = True, failures: dict[str, str] | None = None
) -> list[str]:
    """Why each build faster than ``used`` for this CPU's family (x86 or ARM) is not in use, one line each: the CPU
    lacks its instructions, its build failed (``failures``: the error of each one tried), $SPECDEC_KERNELS chose
    another, or (AMX) Linux did not grant the tiles' state."""
    arm = used == "neon"
    reasons = []
    for name, (needs, _) in VARIANTS.items():
        if name == used:
            break
        if (name == "neon") != arm:
            continue
        if missing := sorted(set(needs) - flags):
            reasons.append(f"{name}: this CPU lacks {', '.join(missing)}")
        elif failures and name in failures:
            reasons.append(f"{name}: its build failed here ({failures[name]}; {FORCE}={name} retries it)")
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
    """Whether a verified build is cached: its library, with the SHA-256 recorded when it was built."""
    return _verified(name or variant() or "avx512")


def compiled():
    """The compiled kernels, or None (``linear`` then takes its exact float64 path) where this machine cannot run or
    build them."""
    return selected().module


def loaded():
    """The compiled kernels where this process has already chosen its build (the native runtime has), else None: for
    a helper that would rather take its torch path than start a build."""
    return selected().module if selected.cache_info().currsize else None


def build_name() -> str:
    """The kernels' build in use (its module's name: variant and build key, and whether the AMX build's tiles run),
    or the float64 reference where none runs."""
    selection = selected()
    return "float64 reference" if selection.module is None else selection.module.__name__ + _tiles_note(selection)


def build_label() -> str:
    """The kernels' build in use in a few words: its variant (and whether the AMX build's tiles run), or the float64
    reference where none runs."""
    selection = selected()
    return "float64 reference" if selection.module is None else selection.name + _tiles_note(selection)


def _tiles_note(selection: Selection) -> str:
    return "" if selection.name != "amx" or selection.module.tiles_in_use() else " (no tiles)"


def kernels_problem() -> str | None:
    """Why the kernels are not available here (no AVX2 or ARM SDOT, or the build's error), or None."""
    return selected().problem


@dataclass(frozen=True)
class Selection:
    """The kernels' build a process loads: the fastest of this CPU's that builds (or is verified in the cache), each
    faster one that fails giving way to the next plainer one."""

    module: ModuleType | None  # the compiled kernels; None: ``linear`` takes its float64 reference
    name: str | None  # its key in VARIANTS
    failures: dict[str, str]  # the error of each build tried before it (of every one tried, where none loads)
    problem: str | None  # why none loads, or None


@functools.cache
def selected() -> Selection:
    """The build this process loads, chosen once; the runtime and `specdec doctor` both ask here. A kernels' folder
    another user could write raises its ConfigError: refused, not worked around with a plainer build."""
    first = variant()
    if first is None:
        return Selection(None, None, {}, "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM)")
    runs = [name for name, (needs, _) in VARIANTS.items() if set(needs) <= cpu_flags()]
    failures = {}
    for name in [first] + runs[runs.index(first) + 1 :]:  # a build the compiler refuses gives way to a plainer one
        try:
            return Selection(build(name=name), name, failures, None)
        except KernelBuildError as exc:  # unwritable cache, no compiler, a compile error
            failures[name] = str(exc)
            log.warning("specdec's %s kernels could not be built (%s): trying a plainer build", name, exc)
    log.warning(
        "specdec's CPU kernels are not available, so native layers use their exact float64 reference: %s",
        next(iter(failures.values())),
    )
    problem = f"the kernels' build failed: {'; '.join(f'{name}: {error}' for name, error in failures.items())}"
    return Selection(None, None, failures, problem)


def build(wait_s: float = BUILD_WAIT_S, name: str | None = None):
    """Load a verified build of the kernels (``name``: a key of ``VARIANTS``; by default this CPU's), else compile it
    (first use: under a minute, said on stderr), one process at a time.

    A verified build (its library's SHA-256 is the one recorded when it was built) is imported without taking the
    lock, so a read-only cache serves. Otherwise torch marks a build in progress with a ``lock`` file and waits,
    without limit, while it exists; a build killed midway leaves it behind. Builds here also hold an OS lock on
    ``specdec.lock``, which dies with its process: holding it, any ``lock`` file left is stale and removed; a live
    build is waited for at most ``wait_s`` seconds.
    """
    name = name or variant()
    if name is None:
        raise KernelBuildError(
            "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM): the native kernels cannot run here"
        )
    folder = build_folder(name)
    if folder.is_dir():
        _refuse_unsafe(folder)
        if _verified(name):
            return _import_verified(name)
    try:
        _make_private(folder)
        _refuse_unsafe(folder)  # before the lock: its file is written
        guard = open(folder / "specdec.lock", "a+")
    except OSError as exc:
        raise KernelBuildError(
            f"the kernels' folder {folder} is not writable ({exc}) and holds no verified build: set SPECDEC_CACHE to "
            f"a folder of your own"
        ) from None
    with guard:
        if _hold(guard, folder, wait_s):
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was stopped midway", stale)
                stale.unlink()
        if _verified(name):  # built by the process this one waited for
            return _import_verified(name)
        library = _library(name)
        if library.exists():
            log.warning(
                "%s does not match the SHA-256 recorded when it was built (or none was recorded): not loading it; "
                "rebuilding the kernels from their sources",
                library,
            )
            _clear(folder)
        else:
            log.warning(
                "compiling specdec's CPU kernels (%s) for this machine, once (under a minute; cached in %s)",
                name,
                folder,
            )
        module = _compile(name, folder)
        _record(library)
        return module


def _compile(name: str, folder: Path):
    """Compile a build with torch's cpp_extension (g++ and ninja) in ``folder``, and import it."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            module_name(name),
            sources=[str(KERNELS / file) for file in SOURCES],
            extra_cflags=[*CFLAGS, *VARIANTS[name][1]],
            extra_include_paths=[str(KERNELS)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, a compile error
        raise KernelBuildError(compiler_error(str(exc))) from None


def _library(name: str) -> Path:
    return build_folder(name) / f"{module_name(name)}.so"


def _digest_file(library: Path) -> Path:
    """Where the SHA-256 of a build's library is recorded when it is built."""
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _verified(name: str) -> bool:
    """Whether a build's library is there with the SHA-256 recorded when it was built."""
    library = _library(name)
    try:
        return _digest_file(library).read_text().strip() == _sha256(library)
    except OSError:
        return False


def _record(library: Path) -> None:
    """Record the SHA-256 of the library just built (under the lock), written whole or not at all."""
    atomic_write_bytes(_digest_file(library), (_sha256(library) + "\n").encode())


def _import_verified(name: str):
    library = _library(name)
    try:
        return _import(module_name(name), library)
    except (ImportError, OSError) as exc:
        raise KernelBuildError(f"{library} does not load ({exc}): remove {library.parent} to rebuild it") from None


def _import(name: str, library: Path):
    """Import the extension module ``name`` from ``library``, as torch's loader does, without building anything."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clear(folder: Path) -> None:
    """Remove a build's outputs (all but the lock held): a library that fails its check was written by another hand,
    so none of its objects is reused either."""
    for path in folder.iterdir():
        if path.name == "specdec.lock":
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _make_private(folder: Path) -> None:
    """Make the kernels' folder and the build's folder in it, each 0700 (the cache folder above them, as any)."""
    folder.parent.parent.mkdir(parents=True, exist_ok=True)
    for path in (folder.parent, folder):
        path.mkdir(mode=0o700, exist_ok=True)


def _refuse_unsafe(folder: Path) -> None:
    """Refuse, in one line, a build's folder, or any folder above it, that another user owns or could write: a library
    put there, or a folder renamed in its place, would run its code as whoever loads the kernels next. The path is
    checked as it resolves (links followed), up to the root; a folder above with the sticky bit (/tmp) may be shared,
    since no one else can rename what is in it. Root's own are trusted (root can write anything anyway), so a cache
    prepared by root and made read-only serves every user."""
    if os.name != "posix":
        return
    real = folder.resolve()
    for path in (real, *real.parents):
        info = os.lstat(path)
        fix = (
            f"set SPECDEC_CACHE to a folder of your own, or remove it (rm -r {shlex.quote(str(path))}; the kernels "
            f"are rebuilt)"
            if path in (real, real.parent)
            else "set SPECDEC_CACHE to a folder that only you (and root) can write, all the way up"
        )
        if info.st_uid not in (os.geteuid(), 0):
            raise ConfigError(
                f"the kernels' folder {path} belongs to user {info.st_uid}, not you, so a library in it could run "
                f"code as you: {fix}"
            )
        shared = path not in (real, real.parent) and info.st_mode & stat.S_ISVTX
        if info.st_mode & 0o022 and not shared:
            raise ConfigError(
                f"the kernels' folder {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}), "
                f"so a library swapped into it would run as you: {fix}"
            )


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
