"""What every command shares: one-line errors, the common options and parsing helpers; defaults from config types."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from specdec.config import (
    DTYPES,
    FORMATS,
    K_POLICIES,
    MAX_K,
    NATIVE_FORMATS,
    PRESETS,
    RUNTIMES,
    PrecisionPlan,
    RuntimeConfig,
)
from specdec.drafters import DRAFT_SPECS
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.models.target import Target as ModelTarget

# No markup anywhere: prompts, outputs, names and paths print exactly as written ("items[j]" stays "items[j]").
err = Console(stderr=True, markup=False, highlight=False)
console = Console(markup=False, highlight=False)
DRAFT_HELP = f"Drafter: {DRAFT_SPECS}. The library's Generator drafts nothing (none) unless given a drafter."
F = TypeVar("F", bound=Callable[..., None])


def default(config: type, name: str) -> Any:
    """The default of field ``name`` of the config dataclass ``config``: the one source of a command's defaults."""
    for f in fields(config):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{config.__name__}.{name} has no default")
    raise ValueError(f"{config.__name__} has no field {name}")


def say(label: str, style: str, message: str, to: Console = err) -> None:
    """One line: a styled label ("error:", "note:") and a message printed as written."""
    to.print(Text.assemble((label, style), " ", message), soft_wrap=True)


def user_errors(fn: F) -> F:
    """Turn a SpecDecError into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> None:
        try:
            fn(*args, **kwargs)
        except SpecDecError as exc:
            say("error:", "red", str(exc))
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


Target = Annotated[str, typer.Option("--target", "-t", help="Bundled alias, model folder, .gguf file or hub id.")]
Draft = Annotated[
    str,
    typer.Option(
        "--draft",
        "-d",
        help=DRAFT_HELP,
    ),
]
Prompts = Annotated[
    str,
    typer.Option(
        help="A prompt set shipped with specdec (default: 44 prompts in four categories; core, mixed, long; "
        "`specdec prompts` lists them) or a JSONL file of {id, category, prompt} objects, one per line."
    ),
]
Dtype = Annotated[str, typer.Option(help=f"Weights dtype (transformers backend): {', '.join(DTYPES)}.")]
# what --runtime names is RuntimeConfig.backend; --backend, its former name, is still accepted
RUNTIME_ALIAS = "--backend is its former name, still accepted."
RuntimeOpt = Annotated[
    str,
    typer.Option(
        "--runtime",
        "--backend",
        help=f"Target runtime: {', '.join(RUNTIMES)} (llama.cpp reads GGUF files and aliases). {RUNTIME_ALIAS}",
    ),
]
NativeFormatOpt = Annotated[
    str,
    typer.Option(
        "--native-format",
        help=f"Native runtime's weights: {', '.join(NATIVE_FORMATS)} (int4: 4-bit groups of 32 as llama.cpp's Q4_1, "
        "about 0.6 of int8's bytes; auto: the faster on this machine, measured once and said, int8 for models under 1B "
        "weights).",
    ),
]
Threads = Annotated[int | None, typer.Option(help="CPU threads for llama.cpp (default: all cores).")]
KPolicyOpt = Annotated[
    str,
    typer.Option(
        help=f"How k is chosen per step: {', '.join(K_POLICIES)} (cost-model prices this machine's target forwards)."
    ),
]
KOpt = Annotated[
    int, typer.Option(help=f"Draft tokens per step (1-{MAX_K}); the most per step for an adaptive --k-policy.")
]
Branches = Annotated[
    int,
    typer.Option(
        help="Most children of a draft node: 1 drafts chains; more lets prompt-lookup and eagle propose trees, "
        "verified in one forward (native and transformers)."
    ),
]
Precision = Annotated[
    str | None,
    typer.Option(
        help=f"Precision plan (transformers; replaces --dtype): a preset ({', '.join(PRESETS)}) or parts like "
        "attention=bfloat16,ffn=int8,head=int8,draft=bfloat16 (formats: " + ", ".join(FORMATS) + ")."
    ),
]
Overwrite = Annotated[bool, typer.Option(help="Replace an existing output folder.")]
Ubatch = Annotated[
    int | None,
    typer.Option(
        help="llama.cpp micro-batch; 1 makes greedy verification bit-identical to one-token decoding (slower)."
    ),
]


def fresh_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise SpecDecError(f"output folder '{out}' exists: pass --overwrite or choose another --out")


def name_list(value: str | None) -> tuple[str, ...]:
    """A comma-separated list of names, blanks dropped ("none, prompt-lookup," is two names)."""
    return tuple(name.strip() for name in (value or "").split(",") if name.strip())


def int_list(option: str, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise SpecDecError(
            f"{option} must be an integer or a comma-separated list of integers, got '{value}'"
        ) from None


def float_pair(option: str, value: str | None) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        start, end = (float(x) for x in value.split(","))
    except ValueError:
        raise SpecDecError(f"{option} takes two numbers, START,END (like 0.7,1.2), got '{value}'") from None
    return start, end


# generate, demo and serve: native where it runs the model (the faster runtime on a CPU), else transformers
FAST_BACKEND = "auto"
FastRuntimeOpt = Annotated[
    str,
    typer.Option(
        "--runtime",
        "--backend",
        help=f"Target runtime: {', '.join(RUNTIMES)} (llama.cpp reads GGUF files and aliases). Deliberately auto: "
        "native where it runs the model, else transformers, so a command starts on the fastest path (the library's "
        f"default is transformers, which runs every model and batches). {RUNTIME_ALIAS}",
    ),
]


def status(message: str):
    """A spinner on stderr with ``message`` as written (rich's status would read brackets in it as markup)."""
    return err.status(Text(message))


def announce_runtime(target: ModelTarget) -> None:
    """One line on stderr: the runtime the target runs on; for one of specdec's packed formats (native), its format, its
    kernels' build and its perplexity against float32 as stored once measured (`specdec doctor --target`), else the
    command that measures it. Nothing is measured here."""
    packed = target.backend.packed_weights()
    if packed is None:
        fallback = f" (native does not run here: {target.fallback})" if target.fallback else ""
        err.print(f"runtime: {target.runtime}{fallback}", style="dim", soft_wrap=True)
        return
    from specdec.models.native.perplexity_record import CHECK_MAX_WEIGHTS, describe, stored_check

    if target.chosen:
        err.print(target.chosen, style="dim", soft_wrap=True)
    from specdec.models.native import kernel_build

    fmt = f"{packed.format} weights, int8 activations, {kernel_build.build_label()} kernels"  # chosen when it opened
    if (stored := stored_check(target.backend.identity)) is not None:
        figure = describe(stored)
    elif packed.count > CHECK_MAX_WEIGHTS:
        figure = f"`specdec ppl --runtime native --target {target.name} --data FILE` measures its perplexity"
    else:
        figure = f"perplexity not measured yet: `specdec doctor --target {target.name}` measures it once"
    err.print(f"runtime: {target.runtime} ({fmt}; {figure})", style="dim", soft_wrap=True)


def runtime_config(
    backend: str,
    dtype: str,
    threads: int | None,
    ubatch: int | None,
    precision: str | None,
    native_format: str = "auto",
) -> RuntimeConfig:
    return RuntimeConfig(
        backend, dtype, threads, ubatch, PrecisionPlan.parse(precision) if precision else None, native_format
    )


@contextmanager
def progress(total: int) -> Iterator[Callable[[str], None]]:
    """A callback to call as each unit of a long run ends, named: a live bar with ETA on a terminal, one line per unit
    with ETA in a log."""
    start, done = time.perf_counter(), 0
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
    with Progress(*columns, TimeElapsedColumn(), console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task("loading models", total=total)

        def advance(name: str) -> None:
            nonlocal done
            done += 1
            bar.update(task, advance=1, description=name)
            if not err.is_terminal:
                left = (time.perf_counter() - start) / done * (total - done)
                err.print(f"{done}/{total} done: {name} (about {left:.0f} s left)", soft_wrap=True)

        yield advance


ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help="A profile from `specdec tune` (DIR/profile.json): its target, runtime, drafter and k settings replace "
        "these options' defaults; options given on the command line still win, by group (docs/tuning.md).",
    ),
]


PROFILE_GROUPS = (
    ("target",),
    # one runtime: a plan tuned for transformers means nothing on llama.cpp
    ("backend", "dtype", "precision", "threads", "ubatch", "native_format"),
    ("draft", "branches", "k", "k_policy"),  # k settings tuned for one drafter
    ("temperature",),
    ("k_cap", "former_k_cap"),  # serve's --k-cap and --window, its former name
)


@dataclass(frozen=True)
class Tuned:
    """A tuned profile's settings for one command, by group (PROFILE_GROUPS): each None where no profile is given, the
    command has no option of the group, or one of them was given (the command line then keeps the whole group)."""

    target: str | None = None
    runtime: RuntimeConfig | None = None
    draft: str | None = None  # the drafter and the k settings tuned for it
    k: int | None = None
    k_policy: str | None = None
    branches: int | None = None
    temperature: float | None = None
    k_cap: str | None = None


def with_profile(ctx: typer.Context, path: Path | None, target: str, given: frozenset[str] = frozenset()) -> Tuned:
    """The settings of the profile at ``path`` that the command takes: those of the groups it has options of and none
    of whose options the command line (or the environment) gave; ``given`` names more options to count as given
    (bench's --methods is its drafter). Warns, naming the difference, when the profile was tuned for another target
    (``target``, the command line's) or machine."""
    if path is None:
        return Tuned()
    from specdec.profile import load_profile

    profile = load_profile(path)
    # Sources are compared by name: typer may bring its own click.
    given = given | {
        name
        for name in ctx.params
        if (source := ctx.get_parameter_source(name)) is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
    }
    present = ctx.params.keys()
    taken = {name for group in PROFILE_GROUPS if present & set(group) and not given & set(group) for name in group}
    generation = profile.generation
    tuned = Tuned(
        target=profile.target if "target" in taken else None,
        runtime=profile.runtime if "backend" in taken else None,
        draft=profile.drafter if "draft" in taken else None,
        k=generation.k if "k" in taken else None,
        k_policy=generation.k_policy if "k_policy" in taken else None,
        branches=generation.branches if "branches" in taken else None,
        temperature=generation.sampling.temperature if "temperature" in taken else None,
        k_cap=profile.batch.k_cap if "k_cap" in taken else None,
    )
    for note in profile.differences(tuned.target or target):
        say("warning:", "yellow", note)
    return tuned


C = TypeVar("C")


def config_from(config: type[C], ctx: typer.Context, **parsed: object) -> C:
    """``config`` built from the command's options named as its fields, and ``parsed`` for those whose option reads
    otherwise (a list, a file). Every field must be one or the other: a renamed option fails here, never silently."""
    return config(**{f.name: parsed[f.name] if f.name in parsed else ctx.params[f.name] for f in fields(config)})


def typed_options(ctx: typer.Context, names: Iterable[str]) -> list[str]:
    """The flags, in the command's order, of the options among ``names`` typed on the command line (not set from the
    environment or left at their defaults)."""
    names = set(names)
    return [
        param.opts[0]
        for param in ctx.command.params
        if param.name in names and ctx.get_parameter_source(param.name).name == "COMMANDLINE"
    ]
