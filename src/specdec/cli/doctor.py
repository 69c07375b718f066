"""`specdec doctor`: what this machine can run, each problem with its fix."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import typer
from rich.text import Text

from specdec.cli.options import console, status, user_errors
from specdec.errors import ConfigError, SpecDecError

# ok; missing: an optional part that is not installed or not possible here; problem: should work and does not
Status = Literal["ok", "missing", "problem"]
PURPOSES = {  # what each extra of pyproject.toml is for
    "llamacpp": "--runtime llama.cpp, the llama.cpp peers of `bench`, --draft gguf:",
    "ray": "serve --ray: replicas on Ray Serve",
    "quality": "the drift guard and `specdec quality`",
    "test": "the test suite",
}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def native_kernels() -> Check:
    """Which kernel build the runtime loads (chosen as the runtime chooses it, fallbacks included), or why none."""
    from specdec.machine import cpu_flags
    from specdec.models.native import kernel_build

    first = kernel_build.variant()
    if first is None:
        return Check(
            "native kernels",
            "missing",
            "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM), which the native backend's kernels need at least",
            "use --runtime transformers (or llama.cpp); --runtime auto chooses transformers by itself",
        )
    ready = kernel_build.is_built(first)
    with status("loading the native kernels" if ready else "building the native kernels (once; under a minute)"):
        try:
            chosen = kernel_build.selected()
        except ConfigError as exc:  # a kernels' folder another user could write: refused
            return Check("native kernels", "problem", str(exc))
    if chosen.module is None:
        compiler = shlex.split(os.environ.get("CXX") or "c++")[0]
        if shutil.which(compiler) is None:
            return Check(
                "native kernels", "problem", f"no C++ compiler ({compiler}) on PATH", "install g++ (apt install g++)"
            )
        return Check("native kernels", "problem", chosen.problem)
    faster = kernel_build.faster_builds_not_used(
        chosen.name,
        cpu_flags(),
        os.environ.get(kernel_build.FORCE),
        chosen.module.tiles_in_use(),
        chosen.failures,
    )
    why = f"; faster builds not in use: {'; '.join(faster)}" if faster else "; the fastest build for this CPU"
    where = kernel_build.build_folder(chosen.name)
    return Check("native kernels", "ok", f"{chosen.name} kernels in use ({where}){why}")


def llama_cpp() -> Check:
    from specdec.models.llamacpp import INSTALL, llama_cpp_installed, llama_cpp_problem

    if not llama_cpp_installed():
        return Check("llama.cpp", "missing", "llama-cpp-python is not installed", INSTALL)
    with status("checking that llama.cpp decodes here (once per build; cached)"):
        problem = llama_cpp_problem()
    if problem is not None:
        return Check("llama.cpp", "problem", problem)  # the message names the rebuild command
    return Check("llama.cpp", "ok", f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')} decodes here")


def bundled_models() -> list[Check]:
    from specdec.models import ALIASES
    from specdec.models.registry import converted_path, is_cached, resolve

    checks = []
    for alias in ALIASES.values():
        name = f"model {alias.name}"
        if not alias.installed():
            checks.append(Check(name, "missing", "its package is not installed", alias.install))
        elif is_cached(source := resolve(alias.name)):
            checks.append(Check(name, "ok", f"converted: {converted_path(source)}"))
        else:
            checks.append(Check(name, "ok", "installed; converted on first use (about a minute, once)"))
    return checks


def cost_cache() -> Check:
    from specdec.models.registry import cache_root

    folder = cache_root() / "costs"
    curves = sorted(folder.glob("*.json")) if folder.is_dir() else []
    detail = (
        f"{len(curves)} measured cost curve(s) in {folder}" if curves else f"empty ({folder}): measured on first use"
    )
    return Check("cost cache", "ok", detail)


def extras() -> list[Check]:
    """Each extra of specdec's own metadata, installed or not (every distribution it names is present)."""
    requirements = importlib.metadata.requires("specdec") or []
    checks = []
    for extra, purpose in PURPOSES.items():
        marker = re.compile(rf"""extra\s*==\s*["']{extra}["']""")
        names = [re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in requirements if marker.search(r)]
        absent = [name for name in names if not _installed(name)]
        if absent:
            fix = f'pip install -c tested-constraints.txt -e ".[{extra}]"'
            checks.append(
                Check(f"extra [{extra}]", "missing", f"for {purpose}; not installed: {', '.join(absent)}", fix)
            )
        else:
            checks.append(Check(f"extra [{extra}]", "ok", f"installed: {purpose}"))
    return checks


def native_check(target: str) -> Check:
    """The native runtime's perplexity against float32 for ``target``: measured once and stored (what `generate` and
    `demo` then say of the runtime), or read where it was."""
    from specdec.bench.perplexity import native_perplexity
    from specdec.config import RuntimeConfig
    from specdec.models import open_target
    from specdec.models.native.perplexity_record import describe, stored_check

    name = f"native perplexity of {target}"
    try:
        opened = open_target(target, RuntimeConfig(backend="native"))
    except ConfigError as exc:
        return Check(name, "missing", f"native does not run it: {exc}")
    packed = opened.backend.packed_weights()
    if packed is None:
        return Check(name, "missing", f"it runs on {opened.runtime}, not native")
    identity = opened.backend.identity
    measuring = f"measuring the native runtime's perplexity against float32 for {target} (once; stored)"
    with status(measuring) if stored_check(identity) is None else nullcontext():
        result = native_perplexity(opened.name, identity, packed.format)
    return Check(name, "ok", f"{packed.format} weights: {describe(result)}")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def guarded(name: str, check: Callable[[], Check | list[Check]]) -> list[Check]:
    """A check's rows, or one problem row with its error: one failing check does not end the report."""
    try:
        found = check()
    except (SpecDecError, OSError, RuntimeError) as exc:
        return [Check(name, "problem", f"the check itself failed: {exc}")]
    return found if isinstance(found, list) else [found]


def diagnose(target: str | None = None) -> list[Check]:
    import torch

    from specdec.machine import cpu_flags, cpu_name

    flags = cpu_flags()
    features = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp") if f in flags)
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return [
        Check("cpu", "ok", f"{cpu_name()}, {os.cpu_count()} cores; {features or 'none of AVX2, AVX-512, AMX'}"),
        Check("torch", "ok", f"{torch.__version__}, {torch.get_num_threads()} threads, {accelerator}"),
        *guarded("native kernels", native_kernels),
        *guarded("llama.cpp", llama_cpp),
        *guarded("bundled models", bundled_models),
        *guarded("cost cache", cost_cache),
        *guarded("extras", extras),
        *(guarded("native perplexity", lambda: native_check(target)) if target else []),
    ]


@user_errors
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")] = False,
    target: Annotated[
        str | None,
        typer.Option(
            help="Also measure the native runtime's perplexity against float32 for this model, once (stored: "
            "`generate` and `demo` then say it when they run on native)."
        ),
    ] = None,
) -> None:
    """Say what this machine can run: CPU features and the native kernel path, torch, the native kernels' build,
    whether llama.cpp runs, the bundled models, the cost cache and the extras installed; each problem with its fix.
    Exits with 1 when something that should work does not."""
    checks = diagnose(target)
    problems = [c for c in checks if c.status == "problem"]
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "problems": len(problems)}))
    else:
        styles = {"ok": "green", "missing": "yellow", "problem": "red"}
        for c in checks:
            console.print(Text.assemble((f"{c.status:<8}", styles[c.status]), (c.name, "bold"), f": {c.detail}"))
            if c.fix:
                console.print(f"{'':<8}fix: {c.fix}")
        console.print(f"{len(problems)} problem(s)" if problems else "no problems")
    if problems:
        raise typer.Exit(1)
