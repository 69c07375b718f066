"""Commands that build drafters from data: `specdec distill`, `specdec distill-data` and `specdec ngram build`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specdec.cli.options import (
    FAST_BACKEND,
    FastRuntimeOpt,
    NativeFormatOpt,
    Target,
    console,
    default,
    err,
    status,
    user_errors,
)
from specdec.config import RuntimeConfig
from specdec.errors import SpecDecError
from specdec.models import DEFAULT_TARGET
from specdec.training.distill import DistillConfig
from specdec.training.native_data import DataConfig
from specdec.training.ngram import NgramBuildConfig

if TYPE_CHECKING:
    from rich.progress import TaskID

Data = Annotated[
    list[str] | None,
    typer.Option(
        help="Training text: files, folders, JSONL (prompt-only records are continued by the target). Repeatable."
    ),
]
DraftOut = Annotated[
    Path, typer.Option(help="Folder for the draft (loads as --draft model:DIR), its teacher data and checkpoints.")
]
Arch = Annotated[
    str,
    typer.Option(
        help="Draft architecture: layers=N,keep=N (kept vocabulary),init=spread|first; or eagle,layers=N,keep=N "
        "(a head on the target's hidden states)."
    ),
]
Steps = Annotated[int, typer.Option(help="Optimizer steps.")]
Batch = Annotated[int, typer.Option(help="Chunks per step.")]
SeqLen = Annotated[int, typer.Option(help="Tokens per chunk.")]
Lr = Annotated[float, typer.Option(help="Peak learning rate (AdamW, cosine schedule).")]
TeacherTokens = Annotated[int, typer.Option(help="Tokens of data the target scores once (top-k kept).")]
OnPolicyTokens = Annotated[
    int,
    typer.Option(help="Of those, tokens the target writes itself, continuing prompts drawn from the data (on-policy)."),
]
GeneralPrompts = Annotated[
    float,
    typer.Option(
        help="Of the prompts the target continues, the share drawn from general topics (everyday questions, story "
        "and essay openings) instead of the data."
    ),
]
ContinueTokens = Annotated[int, typer.Option(help="Longest continuation the target writes per prompt.")]
GenerateBatch = Annotated[int, typer.Option(help="Prompts the target continues at once.")]
TopK = Annotated[int, typer.Option(help="Teacher entries kept per position.")]
EvalEvery = Annotated[int, typer.Option(help="Steps between held-out acceptance evaluations.")]
CheckpointEvery = Annotated[int, typer.Option(help="Steps between checkpoints.")]
InitFrom = Annotated[
    Path | None,
    typer.Option(
        help="Start the draft's own weights from a draft distilled for this target with the same --arch layers "
        "(its kept vocabulary may differ)."
    ),
]
Resume = Annotated[bool, typer.Option(help="Continue the distillation saved in --out.")]


@contextmanager
def phases() -> Iterator[Callable[[str, float, float, dict], None]]:
    """A progress bar per phase of a long run on stderr: the ``progress`` callback training runs report through."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} {task.fields[figures]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err) as progress:
        tasks: dict[str, TaskID] = {}

        def report(phase: str, done: float, total: float, figures: dict) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total, figures="")
            text = ", ".join(
                f"{k.replace('_', ' ')} {v:.3f}" if k == "loss" else f"{k.replace('_', ' ')} {v:.0f}"
                for k, v in figures.items()
            )
            progress.update(tasks[phase], completed=done, total=total, figures=text)

        yield report


@user_errors
def distill(
    out: DraftOut,
    data: Data = None,
    target: Target = DEFAULT_TARGET,
    arch: Arch = str(default(DistillConfig, "arch")),
    steps: Steps = default(DistillConfig, "steps"),
    batch: Batch = default(DistillConfig, "batch"),
    seq_len: SeqLen = default(DistillConfig, "seq_len"),
    lr: Lr = default(DistillConfig, "lr"),
    teacher_tokens: TeacherTokens = default(DistillConfig, "teacher_tokens"),
    on_policy_tokens: OnPolicyTokens = default(DistillConfig, "on_policy_tokens"),
    general_prompts: GeneralPrompts = default(DistillConfig, "general_prompts"),
    continue_tokens: ContinueTokens = default(DistillConfig, "continue_tokens"),
    generate_batch: GenerateBatch = default(DistillConfig, "generate_batch"),
    top_k: TopK = default(DistillConfig, "top_k"),
    eval_every: EvalEvery = default(DistillConfig, "eval_every"),
    checkpoint_every: CheckpointEvery = default(DistillConfig, "checkpoint_every"),
    init_from: InitFrom = None,
    teacher_data: Annotated[
        Path | None,
        typer.Option(
            help="A `specdec distill-data` folder: train on the target's own writing and recorded hidden states "
            "instead of --data."
        ),
    ] = None,
    unroll: Annotated[
        int,
        typer.Option(
            help="An eagle head's training-time test: it drafts this many tokens in training, from the second on its "
            "own features (1: the target's features only)."
        ),
    ] = default(DistillConfig, "unroll"),
    resume: Resume = False,
) -> None:
    """Distil a draft model for a target: the target scores the data once (or its recorded states do, with
    --teacher-data), then a small draft learns to match it."""
    from specdec.models import load_model
    from specdec.training.distill import DistillConfig, DraftArch
    from specdec.training.distill import distill as run_distill

    config = DistillConfig(
        data=tuple(data or ()),
        out=str(out),
        arch=DraftArch.parse(arch),
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        lr=lr,
        teacher_tokens=teacher_tokens,
        on_policy_tokens=on_policy_tokens,
        general_prompts=general_prompts,
        continue_tokens=continue_tokens,
        generate_batch=generate_batch,
        top_k=top_k,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        init_from=str(init_from) if init_from else None,
        teacher_data=str(teacher_data) if teacher_data else None,
        unroll=unroll,
    )
    with status(f"loading {target}"):
        model = load_model(target)
    with phases() as report:
        record = run_distill(model, config, resume=resume, progress=report)
    last = record["evaluations"][-1]
    console.print(
        f"draft saved to {out} (use --draft model:{out}): {record['steps']} steps, "
        f"{record['tokens_trained']:,} tokens, {record['train_s']:.0f} s training; "
        f"held-out acceptance {last['acceptance_rate']:.0%}, "
        f"top-1 agreement {last['top1_agreement']:.0%} (at step 0: {record['evaluations'][0]['acceptance_rate']:.0%})"
    )


@user_errors
def distill_data(
    out: Annotated[Path, typer.Option(help="Folder for the shards and manifest.json (a run there is continued).")],
    target: Target = DEFAULT_TARGET,
    tokens: Annotated[
        int, typer.Option(help="New tokens the target writes in all; run again with more to extend the data.")
    ] = default(DataConfig, "tokens"),
    data: Annotated[
        list[str] | None,
        typer.Option(
            help="Text and code to draw passage prompts from (files, folders; repeatable). Default: the "
            "Python standard library."
        ),
    ] = None,
    batch: Annotated[int, typer.Option(help="Rows the target decodes together (one shard).")] = default(
        DataConfig, "batch"
    ),
    max_new_tokens: Annotated[int, typer.Option(help="Longest continuation per prompt.")] = default(
        DataConfig, "max_new_tokens"
    ),
    max_prompt_tokens: Annotated[int, typer.Option(help="A longer prompt keeps its last tokens.")] = default(
        DataConfig, "max_prompt_tokens"
    ),
    sampled_share: Annotated[
        float, typer.Option(help="Share of rows that sample (at a temperature from 0.7 to 1.0); the rest are greedy.")
    ] = default(DataConfig, "sampled_share"),
    general_share: Annotated[
        float, typer.Option(help="Share of prompts from general topics; the rest are passages of --data.")
    ] = default(DataConfig, "general_share"),
    seed: Annotated[int, typer.Option(help="Seeds the prompts, the temperatures and the sampling.")] = default(
        DataConfig, "seed"
    ),
    backend: FastRuntimeOpt = FAST_BACKEND,
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
) -> None:
    """Have the target write training data for a feature-reading draft head: its own continuations, greedy and
    sampled, with the hidden states the head reads, decoded in batches (resumable: run it again to continue)."""
    from specdec.models import open_target
    from specdec.training.native_data import write_data

    config = DataConfig(
        out=str(out),
        tokens=tokens,
        **({"sources": tuple(data)} if data else {}),
        batch=batch,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        sampled_share=sampled_share,
        general_share=general_share,
        seed=seed,
    )
    with status(f"loading {target}"):
        model = open_target(target, RuntimeConfig(backend=backend, native_format=native_format))
    with phases() as report:
        manifest = write_data(model, config, progress=report)
    shards = manifest["shards"]
    new = sum(s["new_tokens"] for s in shards)
    seconds = sum(s["seconds"] for s in shards)
    console.print(
        f"{out}: {len(shards)} shards, {sum(s['sequences'] for s in shards):,} sequences, {new:,} new tokens "
        f"({sum(s['tokens'] for s in shards):,} with their prompts) on {model.runtime}, "
        f"{new / max(seconds, 1e-9):.0f} new tokens/s"
    )


@user_errors
def ngram_build(
    sources: Annotated[
        list[str],
        typer.Argument(
            help="Text files, folders (searched for text and code), or JSONL files with prompt/continuation fields."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The table file to write.")],
    target: Target = DEFAULT_TARGET,
    order: Annotated[
        int, typer.Option(help="Longest context, in tokens (contexts of 1..ORDER tokens are counted).")
    ] = default(NgramBuildConfig, "order"),
    max_mb: Annotated[
        float, typer.Option(help="Size limit of the table; the rarest n-grams are dropped to fit.")
    ] = default(NgramBuildConfig, "max_mb"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing table.")] = False,
    suffix_cache: Annotated[
        Path | None,
        typer.Option(
            help="Also write the corpus (its last 1,000,000 tokens) as a suffix history that "
            "`specdec serve --draft suffix --suffix-cache FILE` starts from."
        ),
    ] = None,
) -> None:
    """Tokenize a corpus with the target's tokenizer and save an n-gram table for the target (and, with
    --suffix-cache, a suffix history)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from specdec.drafters import SuffixStore
    from specdec.models import load_model
    from specdec.training.ngram import NgramBuildConfig, build_ngram_table

    config = NgramBuildConfig(order=order, max_mb=max_mb)
    for path, flag in ((out, "--out"), (suffix_cache, "--suffix-cache")):
        if path is not None and path.exists() and not overwrite:
            raise SpecDecError(f"'{path}' exists: pass --overwrite or choose another {flag}")
    with status(f"loading the tokenizer of {target}"):
        model = load_model(target)
    if model.tokenizer is None:
        raise SpecDecError(f"model '{target}' has no tokenizer to tokenize the corpus with")
    tokenizer = model.tokenizer
    store = None if suffix_cache is None else SuffixStore()
    columns = (
        TextColumn("counting n-grams"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("corpus", total=None)
        table = build_ngram_table(
            sources,
            lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"],
            model.vocab_size,
            config,
            {"target": model.name, "tokenizer": getattr(tokenizer, "name_or_path", "")},
            lambda done, total: progress.update(task, completed=done, total=total),
            None if store is None else store.add,
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    if store is not None and suffix_cache is not None:
        suffix_cache.parent.mkdir(parents=True, exist_ok=True)
        store.save(suffix_cache, model.name)
        console.print(
            f"suffix history: {store.token_count:,} tokens -> {suffix_cache} "
            f"(use specdec serve --draft suffix --suffix-cache {suffix_cache})"
        )
    console.print(
        f"{table.meta['tokens']:,} tokens from {len(table.meta['sources'])} file(s) -> {len(table.keys):,} n-grams, "
        f"{out.stat().st_size / 2**20:.1f} MB: {out}  (use --draft ngram:{out})"
    )
