"""The benchmark commands: `bench`, `bench-batch`, `bench-serve`, `quality` and `ppl`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from specdec.bench.batch import BatchBenchConfig
from specdec.bench.methods import PEER_METHODS
from specdec.bench.quality import QualityBenchConfig
from specdec.bench.runner import BenchConfig
from specdec.bench.serve_load import LoadConfig
from specdec.cli.options import (
    FAST_BACKEND,
    RUNTIME_ALIAS,
    Draft,
    Dtype,
    FastRuntimeOpt,
    KPolicyOpt,
    NativeFormatOpt,
    Overwrite,
    Precision,
    Prompts,
    RuntimeOpt,
    Target,
    Threads,
    Ubatch,
    console,
    default,
    err,
    fresh_output,
    int_list,
    name_list,
    progress,
    runtime_config,
    say,
    user_errors,
    with_profile,
)
from specdec.config import (
    K_POLICIES,
    PRESETS,
    TREE_BRANCHES,
    TREE_SUFFIX,
    GenerationConfig,
    GuardConfig,
    PrecisionPlan,
    RuntimeConfig,
    SamplingConfig,
)
from specdec.drafters import DRAFT_SPECS
from specdec.models import DEFAULT_TARGET
from specdec.profile import Profile

Methods = Annotated[
    str,
    typer.Option(
        help=f"Comma-separated: drafters ({DRAFT_SPECS}), each also as DRAFTER{TREE_SUFFIX} (trees of up to "
        f"{TREE_BRANCHES} children per node), oracle (the target's own continuation; oracle:0.7 is right with "
        f"probability 0.7 per token), peers ({PEER_METHODS})."
    ),
]
Ks = Annotated[
    str,
    typer.Option(
        help="Draft tokens per step; a comma-separated list sweeps k. Deliberately one fixed k for every method, "
        "peers included, so that they compare at one depth (the library's default is "
        f"{default(GenerationConfig, 'k')} under its {default(GenerationConfig, 'k_policy')} policy)."
    ),
]
KPolicies = Annotated[
    str,
    typer.Option(
        help=f"k policies for specdec's drafters, comma-separated ({', '.join(K_POLICIES)}); deliberately fixed by "
        f"default (the library's default is {default(GenerationConfig, 'k_policy')})."
    ),
]
BenchMaxNewTokens = Annotated[
    int,
    typer.Option(
        help="New tokens per prompt; deliberately the benchmarks' fixed length (the library's default is "
        f"{default(GenerationConfig, 'max_new_tokens')})."
    ),
]
GreedyTemperature = Annotated[float, typer.Option(help="0 = greedy (outputs are compared with none's).")]
Repeats = Annotated[
    int, typer.Option(help="Timed passes over all prompts (methods take turns per prompt, order rotated).")
]
Seed = Annotated[int, typer.Option(help="Sampling seed.")]
BenchOut = Annotated[Path, typer.Option(help="Output folder for results.json, report.md and plots.")]
Strict = Annotated[bool, typer.Option(help="Fail (exit 1) if any greedy output differs from none's.")]
Quick = Annotated[bool, typer.Option(help="Two prompts, 16 tokens: a smoke test.")]
BenchProfile = Annotated[
    Path | None,
    typer.Option(
        help="A profile from `specdec tune`: its target, runtime and k settings become the defaults, and --methods "
        "defaults to none and the profile's drafter; options given on the command line still win."
    ),
]


@user_errors
def bench(
    ctx: typer.Context,
    prompts: Prompts = default(BenchConfig, "prompts"),
    target: Target = DEFAULT_TARGET,
    methods: Methods = ",".join(default(BenchConfig, "methods")),
    k: Ks = ",".join(map(str, default(BenchConfig, "ks"))),
    k_policy: KPolicies = ",".join(default(BenchConfig, "k_policies")),
    max_new_tokens: BenchMaxNewTokens = default(BenchConfig, "max_new_tokens"),
    temperature: GreedyTemperature = default(BenchConfig, "temperature"),
    repeats: Repeats = default(BenchConfig, "repeats"),
    seed: Seed = default(BenchConfig, "seed"),
    dtype: Dtype = default(RuntimeConfig, "dtype"),
    precision: Precision = None,
    backend: RuntimeOpt = default(RuntimeConfig, "backend"),
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
    threads: Threads = default(RuntimeConfig, "threads"),
    ubatch: Ubatch = default(RuntimeConfig, "ubatch"),
    out: BenchOut = Path("bench-out"),
    overwrite: Overwrite = False,
    strict: Strict = default(BenchConfig, "strict"),
    quick: Quick = default(BenchConfig, "quick"),
    profile: BenchProfile = None,
) -> None:
    """Benchmark methods side by side on the same prompts; write results.json, report.md and plots."""

    from specdec.bench.methods import check_method
    from specdec.bench.prompts import load_prompts
    from specdec.bench.report import write_report
    from specdec.bench.runner import BenchConfig, GreedyMismatchError, method_plan, run_benchmark

    fresh_output(out, overwrite)
    methods_given = ctx.get_parameter_source("methods").name == "COMMANDLINE"
    tuned = with_profile(ctx, profile, target, frozenset({"draft"} if methods_given else ()))
    if profile is not None and not methods_given:
        chosen = Profile.load(profile)
        methods = f"none,{chosen.drafter}{TREE_SUFFIX if chosen.generation.branches > 1 else ''}"
    config = BenchConfig(
        prompts=prompts,
        target=tuned.target or target,
        methods=name_list(methods),
        ks=(tuned.k,) if tuned.k else int_list("--k", k),
        k_policies=(tuned.k_policy,) if tuned.k_policy else name_list(k_policy),
        max_new_tokens=max_new_tokens,
        temperature=temperature if tuned.temperature is None else tuned.temperature,
        repeats=repeats,
        seed=seed,
        runtime=tuned.runtime or runtime_config(backend, dtype, threads, ubatch, precision, native_format),
        strict=strict,
        quick=quick,
    )
    count = 2 if quick else len(load_prompts(prompts))
    runnable = ["none"] + [m for m in config.methods if m != "none" and check_method(m, config.target) is None]
    total = len(method_plan(config, runnable)) * count * repeats
    with progress(total) as advance:
        try:
            results = run_benchmark(config, advance)
        except GreedyMismatchError as exc:
            say("strict:", "red", str(exc))
            raise typer.Exit(1) from None
    write_report(results, out)
    _show_bench(results, config)
    console.print(f"report: {out / 'report.md'}")


def _show_bench(results: dict, config: BenchConfig) -> None:
    """The benchmark's notes and its table of methods: speed, speed-up, acceptance, and identity to none's output."""
    for note in results["notes"]:
        say("note:", "yellow", note)
    overall = {name: m["categories"]["overall"] for name, m in results["methods"].items()}
    greedy, runtime = config.temperature == 0, config.runtime
    table = Table("method", "tok/s", "vs none", "acceptance", "identical to none")
    for name, row in overall.items():
        acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
        identical = f"{results['greedy_identical_share'][name]:.0%}" if greedy else "n/a"
        table.add_row(name, f"{row['tokens_per_s']:.2f}", f"{row['speedup_vs_none']:.2f}x", acc, identical)
    console.print(table)
    differs = min(results["greedy_identical_share"].values()) < 1
    if greedy and runtime.backend == "llama.cpp" and (runtime.ubatch or 0) != 1 and differs:
        say(
            "note:",
            "yellow",
            "llama.cpp's many-token forward rounds differently from its one-token forward at its "
            "default micro-batch, so near-ties can flip: --ubatch 1 makes speculative output identical (slower)",
        )


ReportOut = Annotated[Path, typer.Option(help="Output folder for results.json and report.md.")]
BatchSizes = Annotated[str, typer.Option(help="Comma-separated batch sizes.")]
BatchK = Annotated[
    int,
    typer.Option(
        help="Tokens each row drafts per step: all of them under the fixed k_cap, at most under the dynamic k_cap "
        "(the batch's cap on k); deliberately the seed's k (the library's default is "
        f"{default(GenerationConfig, 'k')})."
    ),
]
RequestMaxNewTokens = Annotated[
    int,
    typer.Option(
        help="Most new tokens per request; deliberately the length of the other benchmarks (the library's default "
        f"is {default(GenerationConfig, 'max_new_tokens')})."
    ),
]
Sequential = Annotated[
    bool, typer.Option(help="Also decode the requests one at a time (the baseline batching must beat).")
]


@user_errors
def bench_batch(
    prompts: Prompts = default(BatchBenchConfig, "prompts"),  # a batch of B takes B prompts in turn from its categories
    target: Target = DEFAULT_TARGET,
    draft: Draft = default(BatchBenchConfig, "draft"),
    batch_sizes: BatchSizes = ",".join(map(str, default(BatchBenchConfig, "batch_sizes"))),
    k: BatchK = default(BatchBenchConfig, "k"),
    max_new_tokens: RequestMaxNewTokens = default(BatchBenchConfig, "max_new_tokens"),
    sequential: Sequential = default(BatchBenchConfig, "sequential"),
    backend: FastRuntimeOpt = FAST_BACKEND,
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
    dtype: Dtype = default(RuntimeConfig, "dtype"),
    precision: Precision = None,
    out: ReportOut = Path("bench-batch-out"),
    overwrite: Overwrite = False,
) -> None:
    """Batched decoding: the fixed against the dynamic k_cap (the batch's cap on k) per batch size, against batched
    target-only and one request at a time."""

    from specdec.bench.batch import METHODS, BatchBenchConfig, markdown, run_batch_benchmark

    fresh_output(out, overwrite)
    sizes = int_list("--batch-sizes", batch_sizes)
    config = BatchBenchConfig(
        prompts,
        target,
        draft,
        sizes,
        k,
        max_new_tokens,
        sequential,
        runtime_config(backend, dtype, None, None, precision, native_format),
    )
    with progress(len(sizes) * (len(METHODS) - (not sequential))) as advance:
        results = run_batch_benchmark(config, advance)
    _write_report(out, results, markdown(results))
    table = Table("batch", "method", "tok/s", "vs target-only", "mean latency s", "identical")
    for size, figures in results["batches"].items():
        for name, f in figures.items():
            table.add_row(
                size,
                name,
                f"{f['tokens_per_s']:.1f}",
                f"{f['throughput_vs_target_only']:.2f}x",
                f"{f['mean_latency_s']:.2f}",
                f"{f['identical_share']:.0%}",
            )
    console.print(table)
    console.print(f"report: {out / 'report.md'}")


def _write_report(out: Path, results: dict, report: str) -> None:
    """``out``/results.json and ``out``/report.md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report)


Clients = Annotated[
    str, typer.Option(help="Concurrent streaming clients; a comma-separated list loads each server at each count.")
]
Duration = Annotated[float, typer.Option(help="Seconds of load per configuration and client count.")]
MaxTokens = Annotated[int, typer.Option(help="max_tokens of every request.")]
RequestTemperature = Annotated[
    float, typer.Option(help="Temperature of every request (0: greedy, and answers are checked for identity).")
]
Slots = Annotated[
    int | None,
    typer.Option(
        help="Sequences each server decodes together (specdec --max-batch, llama-server -np); "
        "default: the most clients."
    ),
]
ServerArgs = Annotated[str, typer.Option(help="More `specdec serve` options for both servers, e.g. '--precision cpu'.")]
Keys = Annotated[
    bool, typer.Option(help="The servers require an API key (fresh per run) that the clients send, as deployed.")
]
LlamaServer = Annotated[
    str | None,
    typer.Option(
        help="Path of llama.cpp's llama-server: also load it on the target's GGUF file, without and with its "
        "n-gram speculation."
    ),
]


@user_errors
def bench_serve(
    prompts: Prompts = default(LoadConfig, "prompts"),  # clients take its prompts in turn
    target: Target = DEFAULT_TARGET,
    draft: Draft = default(LoadConfig, "draft"),
    clients: Clients = ",".join(map(str, default(LoadConfig, "clients"))),
    duration: Duration = default(LoadConfig, "duration_s"),
    max_tokens: MaxTokens = default(LoadConfig, "max_tokens"),
    temperature: RequestTemperature = default(LoadConfig, "temperature"),
    slots: Slots = None,
    server_args: ServerArgs = "",
    keys: Keys = default(LoadConfig, "keys"),
    llama_server: LlamaServer = None,
    out: ReportOut = Path("bench-serve-out"),
    overwrite: Overwrite = False,
) -> None:
    """Load-test `specdec serve` on loopback: clients for a bounded time, speculation off and on in the same run (and
    llama.cpp's llama-server on the same GGUF file)."""
    from specdec.bench.serve_load import LoadConfig, markdown, run_load_benchmark

    fresh_output(out, overwrite)
    config = LoadConfig(
        prompts,
        target,
        draft,
        int_list("--clients", clients),
        duration,
        max_tokens,
        temperature,
        slots,
        tuple(server_args.split()),
        keys,
        llama_server,
    )
    report = run_load_benchmark(config, say=lambda line: err.print(line, style="dim"))
    _write_report(out, report, markdown(report))
    print(markdown(report))


Categories = Annotated[str, typer.Option(help="Comma-separated prompt categories to generate from.")]
PerCategory = Annotated[int, typer.Option(help="Prompts taken from each category.")]
LongMaxNewTokens = Annotated[
    int,
    typer.Option(
        help="New tokens per output (EOS is ignored, so every output is this long); deliberately long, this "
        f"benchmark is about long outputs (the library's default is {default(GenerationConfig, 'max_new_tokens')})."
    ),
]
MostK = Annotated[int, typer.Option(help="The most draft tokens per step.")]
SampledTemperature = Annotated[
    float,
    typer.Option(
        help="Temperature of the sampled configurations (deliberately > 0; the library's default is "
        f"{default(SamplingConfig, 'temperature')}, greedy)."
    ),
]
DriftThreshold = Annotated[
    float,
    typer.Option(
        help="The drift monitor's threshold (cosine similarity to the prompt); deliberately set, the benchmark "
        f"measures the monitor (the library's default is {default(GuardConfig, 'drift_threshold')}, off)."
    ),
]
Configs = Annotated[str | None, typer.Option(help="Comma-separated configurations (default: all; see the report).")]
QualityOut = Annotated[Path, typer.Option(help="Output folder for results.json, report.md and the plots.")]


@user_errors
def quality(
    prompts: Prompts = default(QualityBenchConfig, "prompts"),
    target: Target = DEFAULT_TARGET,
    draft: Draft = default(QualityBenchConfig, "draft"),
    categories: Categories = ",".join(default(QualityBenchConfig, "categories")),
    per_category: PerCategory = default(QualityBenchConfig, "per_category"),
    max_new_tokens: LongMaxNewTokens = default(QualityBenchConfig, "max_new_tokens"),
    k: MostK = default(QualityBenchConfig, "k"),
    k_policy: KPolicyOpt = default(QualityBenchConfig, "k_policy"),
    temperature: SampledTemperature = default(QualityBenchConfig, "temperature"),
    drift_threshold: DriftThreshold = default(QualityBenchConfig, "drift_threshold"),
    configs: Configs = None,
    dtype: Dtype = default(RuntimeConfig, "dtype"),
    precision: Precision = None,
    out: QualityOut = Path("quality-out"),
    overwrite: Overwrite = False,
) -> None:
    """Long outputs under each guard and the lossy mode: repetition, loops, diversity, drift, contradictions, speed."""

    from specdec.bench.quality import QualityBenchConfig, configuration_names, run_quality_benchmark, write

    fresh_output(out, overwrite)
    chosen = tuple(c.strip() for c in configs.split(",")) if configs else ()
    config = QualityBenchConfig(
        prompts,
        target,
        draft,
        tuple(c.strip() for c in categories.split(",")),
        per_category,
        max_new_tokens,
        k,
        k_policy,
        temperature,
        drift_threshold,
        chosen,
        runtime_config("transformers", dtype, None, None, precision),
    )
    runs = len(configuration_names(config)) * len(config.categories) * per_category
    with progress(runs + 1) as advance:
        results = run_quality_benchmark(config, advance)
    write(results, out)
    table = Table(
        "configuration", "tok/s", "vs baseline", "repeated 4-grams", "in a loop", "drift sim.", "contradictions"
    )
    for name, per_category in results["summary"].items():
        f = per_category["all"]
        table.add_row(
            name,
            f"{f['tokens_per_s']:.1f}",
            f"{f['speed_vs_baseline']:.2f}x",
            f"{f['repeated_4gram_share']:.1%}",
            f"{f['looping_share']:.1%}",
            f"{f['drift_mean']:.3f}",
            str(f["contradictions"]),
        )
    console.print(table)
    console.print(f"report: {out / 'report.md'}")


@user_errors
def ppl(
    data: Annotated[str, typer.Option(help="Text or JSONL file to score.")],
    target: Target = DEFAULT_TARGET,
    precision: Annotated[
        str,
        typer.Option(
            help=f"Precision plan: a preset ({', '.join(PRESETS)}) or component=format parts; deliberately bf16, since "
            f"float32 against itself says nothing (the library's default is {default(RuntimeConfig, 'precision')}: "
            "float32 weights)."
        ),
    ] = "bf16",
    backend: Annotated[
        str,
        typer.Option(
            "--runtime",
            "--backend",
            help="transformers (under --precision) or native (under --native-format; --precision is ignored). "
            f"{RUNTIME_ALIAS}",
        ),
    ] = default(RuntimeConfig, "backend"),
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
    max_tokens: Annotated[int, typer.Option(help="Tokens of the file to score.")] = 8192,
    window: Annotated[int, typer.Option(help="Tokens per scored window (each scored from its own start).")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Perplexity of the target under a precision plan or on the native backend, and its difference from float32 on the
    same tokens."""
    from rich.progress import Progress

    from specdec.bench.perplexity import perplexity

    plan = None if backend == "native" else PrecisionPlan.parse(precision)
    runtime = RuntimeConfig(backend=backend, precision=plan, native_format=native_format)
    with Progress(console=err, transient=True) as bar:
        tasks: dict[str, object] = {}

        def report(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"scoring ({label})", total=total)
            bar.update(tasks[label], completed=done)

        result = perplexity(target, runtime, data, max_tokens=max_tokens, window=window, progress=report)
    if as_json:
        print(
            json.dumps(
                {
                    "plan": result.plan,
                    "perplexity": result.perplexity,
                    "float32_perplexity": result.float32_perplexity,
                    "delta": result.delta,
                    "tokens": result.tokens,
                }
            )
        )
        return
    console.print(
        f"{target} [{result.plan}]: perplexity {result.perplexity:.3f} vs float32 {result.float32_perplexity:.3f} "
        f"(delta {result.delta:+.3f}) on {result.tokens:,} tokens of {data}"
    )
