"""`specdec` commands. They parse options into the shared config types and call the library."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specdec.bench.methods import PEER_METHODS
from specdec.bench.runner import DEFAULT_METHODS
from specdec.config import (
    DTYPES,
    FORMATS,
    K_POLICIES,
    PRESETS,
    RUNTIMES,
    BatchConfig,
    GenerationConfig,
    GuardConfig,
    PrecisionPlan,
    RuntimeConfig,
    SamplingConfig,
    ServeConfig,
    TypicalAcceptance,
)
from specdec.drafters import DRAFT_SPECS
from specdec.errors import ConfigError, SpecDecError
from specdec.models import ALIASES, DEFAULT_TARGET

app = typer.Typer(help="Lossless speculative decoding for LLM text generation.", no_args_is_help=True, add_completion=False)
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., None])


def user_errors(fn: F) -> F:
    """Turn a SpecDecError into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> None:
        try:
            fn(*args, **kwargs)
        except SpecDecError as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)  # messages may hold [brackets]
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


Target = Annotated[str, typer.Option("--target", "-t", help="Bundled alias, model folder, .gguf file or hub id.")]
Draft = Annotated[str, typer.Option("--draft", "-d", help=f"Drafter: {DRAFT_SPECS}.")]
Dtype = Annotated[str, typer.Option(help=f"Weights dtype (transformers backend): {', '.join(DTYPES)}.")]
BackendOpt = Annotated[
    str, typer.Option("--backend", help=f"Target runtime: {', '.join(RUNTIMES)} (llama.cpp reads GGUF files and aliases).")
]
Threads = Annotated[int | None, typer.Option(help="CPU threads for llama.cpp (default: all cores).")]
KPolicyOpt = Annotated[
    str, typer.Option(help=f"How k is chosen per step: {', '.join(K_POLICIES)} (cost-model prices this machine's target forwards).")
]
Precision = Annotated[
    str | None,
    typer.Option(
        help=f"Precision plan (transformers; replaces --dtype): a preset ({', '.join(PRESETS)}) or parts like "
        "attention=bfloat16,ffn=int8,head=int8,draft=bfloat16 (formats: " + ", ".join(FORMATS) + ")."
    ),
]
Ubatch = Annotated[
    int | None, typer.Option(help="llama.cpp micro-batch; 1 makes greedy verification bit-identical to one-token decoding (slower).")
]


def fresh_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise SpecDecError(f"output folder '{out}' exists: pass --overwrite or choose another --out")


def int_list(option: str, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise SpecDecError(f"{option} must be an integer or a comma-separated list of integers, got '{value}'") from None


def float_pair(option: str, value: str | None) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        start, end = (float(x) for x in value.split(","))
    except ValueError:
        raise SpecDecError(f"{option} takes two numbers, START,END (like 0.7,1.2), got '{value}'") from None
    return start, end


def runtime_config(backend: str, dtype: str, threads: int | None, ubatch: int | None, precision: str | None) -> RuntimeConfig:
    return RuntimeConfig(backend, dtype, threads, ubatch, PrecisionPlan.parse(precision) if precision else None)


@app.command()
@user_errors
def generate(
    prompt: Annotated[str, typer.Argument(help="Text to continue.")],
    target: Target = DEFAULT_TARGET,
    draft: Draft = "prompt-lookup",
    k: Annotated[int, typer.Option(help="Draft tokens per step (1-32); the most per step for an adaptive --k-policy.")] = 8,
    k_policy: KPolicyOpt = "cost-model",
    max_new_tokens: Annotated[int, typer.Option(help="Most new tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    top_k: Annotated[int | None, typer.Option(help="Keep only the k most likely tokens.")] = None,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Random seed, for reproducible sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    dtype: Dtype = "float32",
    precision: Precision = None,
    backend: BackendOpt = "transformers",
    threads: Threads = None,
    ubatch: Ubatch = None,
    stream: Annotated[bool, typer.Option(help="Print text as it is accepted.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text, token_ids and stats.")] = False,
    repetition_guard: Annotated[
        bool, typer.Option(help="Guard: while the output ends in a loop, block the token that continues it.")
    ] = False,
    temperature_schedule: Annotated[
        str | None, typer.Option(help="Guard: temperature from START to END over 512 new tokens, e.g. 0.7,1.2 (needs --temperature > 0).")
    ] = None,
    anchor_every: Annotated[int | None, typer.Option(help="Guard: one target-only step and a drafter resync every N new tokens.")] = None,
    drift_threshold: Annotated[
        float | None, typer.Option(help="Guard: report drift when a 100-token window's similarity to the prompt falls below this.")
    ] = None,
    drift_anchor: Annotated[bool, typer.Option(help="A drift event also triggers an anchor step.")] = False,
    typical_acceptance: Annotated[
        bool, typer.Option(help="LOSSY: accept any plausible draft token (typical acceptance); output is no longer the target's own.")
    ] = False,
) -> None:
    """Generate a continuation of PROMPT with speculative decoding."""
    from specdec import Generator

    config = GenerationConfig(
        k=k,
        k_policy=k_policy,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=tuple(stop or ()),
        seed=seed,
        guards=GuardConfig(
            repetition=repetition_guard,
            temperature_schedule=float_pair("--temperature-schedule", temperature_schedule),
            anchor_every=anchor_every,
            drift_threshold=drift_threshold,
            drift_anchor=drift_anchor,
        ),
        typical_acceptance=TypicalAcceptance() if typical_acceptance else None,
    )
    if typical_acceptance:
        err.print("[yellow]typical acceptance is LOSSY: the output is not exactly the target's own[/yellow]")
    if not prompt.strip():
        raise SpecDecError("the prompt is empty: pass some text to continue")
    with err.status(f"loading {target}" + (f" and {draft}" if draft != "none" else "")):
        generator = Generator(target, draft, config, runtime_config(backend, dtype, threads, ubatch, precision))
    if stream and not as_json:
        run = generator.stream(prompt)
        for piece in run:
            print(piece, end="", flush=True)
        print()
        return
    result = generator.generate(prompt)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    print(result.text)
    s = result.stats
    err.print(
        f"[dim]{s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.1f} tok/s), {s.target_forwards} target forwards, "
        f"acceptance {s.acceptance_rate:.0%}, finish: {result.finish_reason}[/dim]"
    )
    for event in s.events:
        err.print(f"[dim]guard event: {event}[/dim]", highlight=False)


DEMO_PROMPT = (
    "def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n        for j in range(n - i - 1):\n"
    "            if items[j] > items[j + 1]:\n                items[j], items[j + 1] = items[j + 1], items[j]\n"
    "    return items\n\n\n# The same function with type hints and a docstring:\ndef bubble_sort("
)


@app.command()
@user_errors
def demo(
    target: Target = DEFAULT_TARGET,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate in each run.")] = 64,
    k: Annotated[int, typer.Option(help="Draft tokens per step.")] = 8,
) -> None:
    """Generate once without and once with speculation (prompt lookup) and print the speed-up."""
    from specdec import Generator
    from specdec.models import load_model

    with err.status(f"loading {target} (the first run converts the GGUF file once, about a minute)"):
        model = load_model(target)
    config = GenerationConfig(k=k, max_new_tokens=max_new_tokens)
    runs = {}
    for spec in ("none", "prompt-lookup"):
        with err.status(f"generating with draft={spec}"):
            generator = Generator(model, spec, config)
            generator.generate(DEMO_PROMPT, max_new_tokens=4)  # warm-up
            runs[spec] = generator.generate(DEMO_PROMPT)
    base, spec_run = runs["none"], runs["prompt-lookup"]
    err.print(f"[bold]prompt[/bold] ({target}):\n{DEMO_PROMPT}")
    err.print(f"[bold]output[/bold]:\n{spec_run.text}\n")
    table = Table("draft", "tokens", "tok/s", "target forwards", "acceptance")
    for spec, r in runs.items():
        s = r.stats
        table.add_row(spec, str(s.new_tokens), f"{s.tokens_per_s:.1f}", str(s.target_forwards), f"{s.acceptance_rate:.0%}")
    Console().print(table)
    same = "identical" if base.token_ids == spec_run.token_ids else "DIFFERENT"
    Console().print(
        f"speed-up: [bold]{spec_run.stats.tokens_per_s / base.stats.tokens_per_s:.2f}x[/bold]; output {same} to target-only greedy"
    )


@app.command()
@user_errors
def bench(
    prompts: Annotated[
        str, typer.Option(help="JSONL prompt file: one {id, category, prompt} per line.")
    ] = "benchmarks/prompts/default.jsonl",
    target: Target = DEFAULT_TARGET,
    methods: Annotated[str, typer.Option(help=f"Comma-separated: drafters ({DRAFT_SPECS}), oracle, peers ({PEER_METHODS}).")] = ",".join(
        DEFAULT_METHODS
    ),
    k: Annotated[str, typer.Option(help="Draft tokens per step; a comma-separated list sweeps k.")] = "4",
    k_policy: Annotated[str, typer.Option(help=f"k policies for specdec's drafters, comma-separated ({', '.join(K_POLICIES)}).")] = "fixed",
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy (outputs are compared with none's).")] = 0.0,
    repeats: Annotated[int, typer.Option(help="Timed passes over all prompts (methods take turns per prompt, order rotated).")] = 1,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    dtype: Dtype = "float32",
    precision: Precision = None,
    backend: BackendOpt = "transformers",
    threads: Threads = None,
    ubatch: Ubatch = None,
    out: Annotated[Path, typer.Option(help="Output folder for results.json, report.md and plots.")] = Path("bench-out"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    strict: Annotated[bool, typer.Option(help="Fail (exit 1) if any greedy output differs from none's.")] = False,
    quick: Annotated[bool, typer.Option(help="Two prompts, 16 tokens: a smoke test.")] = False,
) -> None:
    """Benchmark methods side by side on the same prompts; write results.json, report.md and plots."""
    from rich.progress import Progress

    from specdec.bench.methods import check_method
    from specdec.bench.prompts import load_prompts
    from specdec.bench.report import write_report
    from specdec.bench.runner import BenchConfig, GreedyMismatchError, method_plan, run_benchmark

    fresh_output(out, overwrite)
    ks = int_list("--k", k)
    config = BenchConfig(
        prompts=prompts,
        target=target,
        methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
        ks=ks,
        k_policies=tuple(p.strip() for p in k_policy.split(",") if p.strip()),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        repeats=repeats,
        seed=seed,
        runtime=runtime_config(backend, dtype, threads, ubatch, precision),
        strict=strict,
        quick=quick,
    )
    count = 2 if quick else len(load_prompts(prompts))
    runnable = ["none"] + [m for m in config.methods if m != "none" and check_method(m, target) is None]
    total = len(method_plan(config, runnable)) * count * repeats
    with Progress(console=err) as progress:
        task = progress.add_task("loading models", total=total)
        try:
            results = run_benchmark(config, lambda name: progress.update(task, advance=1, description=name))
        except GreedyMismatchError as exc:
            err.print(f"[red]strict:[/red] {exc}")
            raise typer.Exit(1) from None
    write_report(results, out)
    for note in results["notes"]:
        err.print(f"[yellow]note:[/yellow] {note}")
    overall = {name: m["categories"]["overall"] for name, m in results["methods"].items()}
    greedy = temperature == 0
    table = Table("method", "tok/s", "vs none", "acceptance", "identical to none" if greedy else "identical (sampled: n/a)")
    for name, row in overall.items():
        acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
        identical = f"{results['greedy_identical_share'][name]:.0%}" if greedy else "-"
        table.add_row(name, f"{row['tokens_per_s']:.2f}", f"{row['speedup_vs_none']:.2f}x", acc, identical)
    Console().print(table)
    if greedy and backend == "llama.cpp" and (ubatch or 0) != 1 and min(results["greedy_identical_share"].values()) < 1:
        err.print(
            "[yellow]note:[/yellow] llama.cpp's many-token forward rounds differently from its one-token forward at its "
            "default micro-batch, so near-ties can flip: --ubatch 1 makes speculative output identical (slower)"
        )
    Console().print(f"report: {out / 'report.md'}")


@app.command("bench-batch")
@user_errors
def bench_batch(
    prompts: Annotated[
        str, typer.Option(help="JSONL prompt file; a batch of B takes B prompts in turn from its categories.")
    ] = "benchmarks/prompts/default.jsonl",
    target: Target = DEFAULT_TARGET,
    draft: Draft = "prompt-lookup",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "8,16,32",
    k: Annotated[int, typer.Option(help="The fixed window, and the largest dynamic window.")] = 5,
    max_new_tokens: Annotated[int, typer.Option(help="Most new tokens per request.")] = 64,
    sequential: Annotated[bool, typer.Option(help="Also decode the requests one at a time (the baseline batching must beat).")] = True,
    dtype: Dtype = "float32",
    precision: Precision = None,
    out: Annotated[Path, typer.Option(help="Output folder for results.json and report.md.")] = Path("bench-batch-out"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
) -> None:
    """Batched decoding: fixed vs dynamic speculation window per batch size, against batched target-only and one request at a time."""
    from rich.progress import Progress

    from specdec.bench.batch import METHODS, BatchBenchConfig, markdown, run_batch_benchmark

    fresh_output(out, overwrite)
    sizes = int_list("--batch-sizes", batch_sizes)
    config = BatchBenchConfig(
        prompts, target, draft, sizes, k, max_new_tokens, sequential, runtime_config("transformers", dtype, None, None, precision)
    )
    with Progress(console=err) as progress:
        task = progress.add_task("loading models", total=len(sizes) * (len(METHODS) - (not sequential)))
        results = run_batch_benchmark(config, lambda name: progress.update(task, advance=1, description=name))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(markdown(results))
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
    Console().print(table)
    Console().print(f"report: {out / 'report.md'}")


@app.command()
@user_errors
def quality(
    prompts: Annotated[str, typer.Option(help="JSONL prompt file.")] = "benchmarks/prompts/default.jsonl",
    target: Target = DEFAULT_TARGET,
    draft: Draft = "default",
    categories: Annotated[str, typer.Option(help="Comma-separated prompt categories to generate from.")] = "open-writing,chat",
    per_category: Annotated[int, typer.Option(help="Prompts taken from each category.")] = 3,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per output (EOS is ignored, so every output is this long).")] = 512,
    k: Annotated[int, typer.Option(help="The most draft tokens per step.")] = 8,
    k_policy: KPolicyOpt = "cost-model",
    temperature: Annotated[float, typer.Option(help="Temperature of the sampled configurations.")] = 0.7,
    drift_threshold: Annotated[float, typer.Option(help="The drift monitor's threshold (cosine similarity to the prompt).")] = 0.2,
    configs: Annotated[str | None, typer.Option(help="Comma-separated configurations (default: all; see the report).")] = None,
    dtype: Dtype = "float32",
    precision: Precision = None,
    out: Annotated[Path, typer.Option(help="Output folder for results.json, report.md and the plots.")] = Path("quality-out"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
) -> None:
    """Long generations under each guard and the lossy mode: repetition, loops, diversity, drift, contradictions, speed."""
    from rich.progress import Progress

    from specdec.bench.quality import QualityBenchConfig, configuration_names, run_quality_benchmark, write

    fresh_output(out, overwrite)
    chosen = tuple(c.strip() for c in configs.split(",")) if configs else ()
    config = QualityBenchConfig(
        prompts, target, draft, tuple(c.strip() for c in categories.split(",")), per_category, max_new_tokens, k, k_policy,
        temperature, drift_threshold, chosen, runtime_config("transformers", dtype, None, None, precision),
    )  # fmt: skip
    runs = len(configuration_names(config)) * len(config.categories) * per_category
    with Progress(console=err) as progress:
        task = progress.add_task("loading models", total=runs + 1)
        results = run_quality_benchmark(config, lambda name: progress.update(task, advance=1, description=name))
    write(results, out)
    table = Table("configuration", "tok/s", "vs baseline", "repeated 4-grams", "in a loop", "drift sim.", "contradictions")
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
    Console().print(table)
    Console().print(f"report: {out / 'report.md'}")


@app.command()
@user_errors
def serve(
    context: typer.Context,
    target: Annotated[
        str, typer.Option("--target", "-t", envvar="SPECDEC_TARGET", help="Bundled alias, model folder or hub id.")
    ] = DEFAULT_TARGET,
    draft: Annotated[str, typer.Option("--draft", "-d", envvar="SPECDEC_DRAFT", help=f"Drafter: {DRAFT_SPECS}.")] = "prompt-lookup",
    host: Annotated[str, typer.Option(envvar="SPECDEC_HOST", help="Address to listen on (0.0.0.0 for every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="SPECDEC_PORT", help="TCP port.")] = 8000,
    k: Annotated[int, typer.Option(help="Draft tokens per step (the most per step for an adaptive --k-policy).")] = 8,
    k_policy: KPolicyOpt = "cost-model",
    window: Annotated[str, typer.Option(help="Batch speculation window: dynamic (capped by load) or fixed.")] = "dynamic",
    max_batch: Annotated[int, typer.Option(envvar="SPECDEC_MAX_BATCH", help="Sequences decoded together; more requests wait.")] = 16,
    max_queue: Annotated[int, typer.Option(envvar="SPECDEC_MAX_QUEUE", help="Waiting requests before new ones get 429.")] = 64,
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request does not set it.")] = 256,
    drain: Annotated[float, typer.Option(help="Seconds in-flight requests get to finish on shutdown.")] = 30.0,
    dtype: Dtype = "float32",
    precision: Annotated[
        str | None, typer.Option(envvar="SPECDEC_PRECISION", help="Precision plan: a preset or parts (see `specdec generate --help`).")
    ] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Run replicas on Ray Serve behind one endpoint (needs the ray extra).")] = False,
    replicas: Annotated[int, typer.Option(envvar="SPECDEC_REPLICAS", help="With --ray: replicas (the autoscaling minimum).")] = 2,
    max_replicas: Annotated[int | None, typer.Option(help="With --ray: autoscale up to this many replicas on load.")] = None,
    target_ongoing_requests: Annotated[
        float, typer.Option(help="With --ray and --max-replicas: requests in flight per replica to aim at.")
    ] = 8.0,
    upscale_delay: Annotated[
        float, typer.Option(help="With --max-replicas: seconds load stays above target before a replica is added.")
    ] = 30.0,
    downscale_delay: Annotated[
        float, typer.Option(help="With --max-replicas: seconds load stays below target before a replica is removed.")
    ] = 600.0,
    cpus_per_replica: Annotated[float, typer.Option(help="With --ray: CPUs each replica reserves.")] = 1.0,
    gpus_per_replica: Annotated[float, typer.Option(help="With --ray: GPUs each replica reserves.")] = 0.0,
    ingress_replicas: Annotated[
        int, typer.Option(help="With --ray: replicas of the ingress that relays requests (on many nodes, about one per node).")
    ] = 1,
    ray_address: Annotated[
        str | None,
        typer.Option(envvar="RAY_ADDRESS", help="With --ray: a running cluster (auto, ray://host:10001); default starts one here."),
    ] = None,
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API with speculative continuous batching."""
    from specdec import Generator
    from specdec.serving import serve as run_server

    if not ray:
        _refuse_ray_options_without_ray(context)
    serve_config = ServeConfig(host, port, max_batch, max_queue, default_max_tokens, drain)
    config = GenerationConfig(k=k, k_policy=k_policy)
    runtime = runtime_config("transformers", dtype, None, None, precision)
    if ray:
        from specdec.config import RayConfig
        from specdec.serving.ray_serve import ReplicaSpec, require_ray, serve_on_ray

        ray_config = RayConfig(
            replicas=replicas,
            max_replicas=max_replicas,
            target_ongoing_requests=target_ongoing_requests,
            upscale_delay_s=upscale_delay,
            downscale_delay_s=downscale_delay,
            cpus_per_replica=cpus_per_replica,
            gpus_per_replica=gpus_per_replica,
            ingress_replicas=ingress_replicas,
            address=ray_address,
        )
        require_ray()
        spec = ReplicaSpec(target, draft, config, runtime, BatchConfig(window=window), serve_config)
        err.print(f"starting {replicas} replica(s) of '{target}' with draft '{draft}' on Ray Serve")
        serve_on_ray(spec, ray_config, ready=lambda: err.print(f"serving on http://{host}:{port}/v1 (Ray Serve)"))
        return
    with err.status(f"loading {target}" + (f" and {draft}" if draft != "none" else "")):
        generator = Generator(target, draft, config, runtime, batch=BatchConfig(window=window))
        generator.batch_decoder()  # measures this machine's batch costs now (cached), not on the first request
    err.print(f"serving '{generator.target.name}' with draft '{draft}' on http://{host}:{port}/v1")
    run_server(generator, serve_config)


RAY_OPTIONS = (
    "replicas",
    "max_replicas",
    "target_ongoing_requests",
    "upscale_delay",
    "downscale_delay",
    "cpus_per_replica",
    "gpus_per_replica",
    "ingress_replicas",
    "ray_address",
)


def _refuse_ray_options_without_ray(context: typer.Context) -> None:
    """Ray options typed on the command line without --ray would be ignored: say so (set from the environment, they are)."""
    typed = [f"--{name.replace('_', '-')}" for name in RAY_OPTIONS if context.get_parameter_source(name).name == "COMMANDLINE"]
    if typed:
        verb = "applies" if len(typed) == 1 else "apply"
        raise ConfigError(f"{', '.join(typed)} {verb} only with --ray: add --ray, or drop {'it' if len(typed) == 1 else 'them'}")


@app.command("bench-serve")
@user_errors
def bench_serve(
    prompts: Annotated[str, typer.Option(help="JSONL prompt file; clients take its prompts in turn.")] = "benchmarks/prompts/default.jsonl",
    target: Target = DEFAULT_TARGET,
    draft: Draft = "prompt-lookup",
    clients: Annotated[int, typer.Option(help="Concurrent streaming clients.")] = 8,
    duration: Annotated[float, typer.Option(help="Seconds of load per configuration.")] = 60.0,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every request.")] = 64,
    server_args: Annotated[
        str, typer.Option(help="More `specdec serve` options for both servers, e.g. '--precision cpu --max-batch 8'.")
    ] = "",
    out: Annotated[Path, typer.Option(help="Output folder for results.json and report.md.")] = Path("bench-serve-out"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
) -> None:
    """Load-test `specdec serve` on loopback: N clients for a bounded time, speculation off and on in the same run."""
    from specdec.bench.serve_load import LoadConfig, markdown, run_load_benchmark

    fresh_output(out, overwrite)
    config = LoadConfig(prompts, target, draft, clients, duration, max_tokens, tuple(server_args.split()))
    report = run_load_benchmark(config, say=lambda line: err.print(f"[dim]{line}[/dim]"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))


@app.command()
def models() -> None:
    """List the bundled model aliases, where their files are, and whether they are converted and cached."""
    from specdec.models.registry import bundled_draft, cache_root, converted_path, is_cached, resolve

    table = Table("alias", "description", "package", "converted copy", "bundled draft")
    for alias in ALIASES.values():
        installed = importlib.util.find_spec(alias.package.replace("-", "_")) is not None
        source = resolve(alias.name)
        cached = f"cached: {converted_path(source)}" if is_cached(source) else "not yet (converted on first use)"
        draft = "--draft default" if bundled_draft(alias.name) else "-"
        table.add_row(alias.name, alias.description, "installed" if installed else f"missing: {alias.install}", cached, draft)
    Console().print(table)
    Console().print(f"cache folder: {cache_root()} (set SPECDEC_CACHE to move it)")


@app.command()
@user_errors
def ppl(
    data: Annotated[str, typer.Option(help="Text or JSONL file to score.")],
    target: Target = DEFAULT_TARGET,
    precision: Annotated[str, typer.Option(help=f"Precision plan: a preset ({', '.join(PRESETS)}) or component=format parts.")] = "bf16",
    max_tokens: Annotated[int, typer.Option(help="Tokens of the file to score.")] = 8192,
    window: Annotated[int, typer.Option(help="Tokens per scored window (each scored from its own start).")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Perplexity of the target under a precision plan, and its difference from float32 on the same tokens."""
    from rich.progress import Progress

    from specdec.bench.perplexity import perplexity

    plan = PrecisionPlan.parse(precision)
    with Progress(console=err, transient=True) as progress:
        tasks: dict[str, object] = {}

        def report(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(f"scoring ({label})", total=total)
            progress.update(tasks[label], completed=done)

        result = perplexity(target, plan, data, max_tokens=max_tokens, window=window, progress=report)
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
    Console().print(
        f"{target} [{result.plan}]: perplexity {result.perplexity:.3f} vs float32 {result.float32_perplexity:.3f} "
        f"(delta {result.delta:+.3f}) on {result.tokens:,} tokens of {data}"
    )


@app.command()
@user_errors
def distill(
    data: Annotated[
        list[str], typer.Option(help="Training text: files, folders, JSONL (prompt-only records are continued by the target). Repeatable.")
    ],
    out: Annotated[Path, typer.Option(help="Folder for the draft (loads as --draft model:DIR), its teacher data and checkpoints.")],
    target: Target = DEFAULT_TARGET,
    arch: Annotated[
        str, typer.Option(help="Draft architecture: layers=N,keep=N (kept vocabulary),init=spread|first.")
    ] = "layers=2,keep=16384,init=spread",
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 400,
    batch: Annotated[int, typer.Option(help="Chunks per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per chunk.")] = 128,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, cosine schedule).")] = 1e-3,
    teacher_tokens: Annotated[int, typer.Option(help="Tokens of data the target scores once (top-k kept).")] = 400_000,
    on_policy_tokens: Annotated[
        int, typer.Option(help="Of those, tokens the target writes itself, continuing prompts drawn from the data (on-policy).")
    ] = 0,
    continue_tokens: Annotated[int, typer.Option(help="Longest continuation the target writes per prompt.")] = 128,
    generate_batch: Annotated[int, typer.Option(help="Prompts the target continues at once.")] = 16,
    top_k: Annotated[int, typer.Option(help="Teacher entries kept per position.")] = 32,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out acceptance evaluations.")] = 100,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints.")] = 50,
    resume: Annotated[bool, typer.Option(help="Continue the distillation saved in --out.")] = False,
) -> None:
    """Distil a draft model for a target: the target scores the data once, then a small draft learns to match it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from specdec.models import load_model
    from specdec.training.distill import DistillConfig, DraftArch
    from specdec.training.distill import distill as run_distill

    config = DistillConfig(
        data=tuple(data),
        out=str(out),
        arch=DraftArch.parse(arch),
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        lr=lr,
        teacher_tokens=teacher_tokens,
        on_policy_tokens=on_policy_tokens,
        continue_tokens=continue_tokens,
        generate_batch=generate_batch,
        top_k=top_k,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
    )
    with err.status(f"loading {target}"):
        model = load_model(target)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} {task.fields[figures]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err) as progress:
        tasks: dict[str, object] = {}

        def report(phase: str, done: float, total: float, figures: dict) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(phase, total=total, figures="")
            text = ", ".join(f"{k} {v:.3f}" if k == "loss" else f"{k} {v:.0f}" for k, v in figures.items())
            progress.update(tasks[phase], completed=done, total=total, figures=text)

        record = run_distill(model, config, resume=resume, progress=report)
    last = record["evaluations"][-1]
    Console().print(
        f"draft saved to {out} (use --draft model:{out}): {record['steps']} steps, {record['tokens_trained']:,} tokens, "
        f"{record['train_s']:.0f} s training; held-out acceptance {last['acceptance_rate']:.0%}, "
        f"top-1 agreement {last['top1_agreement']:.0%} (at step 0: {record['evaluations'][0]['acceptance_rate']:.0%})"
    )


ngram_app = typer.Typer(help="Corpus n-gram tables for --draft ngram:FILE.", no_args_is_help=True)
app.add_typer(ngram_app, name="ngram")


@ngram_app.command("build")
@user_errors
def ngram_build(
    sources: Annotated[
        list[str], typer.Argument(help="Text files, folders (searched for text and code), or JSONL files with prompt/continuation fields.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The table file to write.")],
    target: Target = DEFAULT_TARGET,
    order: Annotated[int, typer.Option(help="Longest context, in tokens (contexts of 1..ORDER tokens are counted).")] = 4,
    max_mb: Annotated[float, typer.Option(help="Size limit of the table; the rarest n-grams are dropped to fit.")] = 64.0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing table.")] = False,
) -> None:
    """Tokenize a corpus with the target's tokenizer and save an n-gram table for the target."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from specdec.models import load_model
    from specdec.training.ngram import NgramBuildConfig, build_ngram_table

    config = NgramBuildConfig(order=order, max_mb=max_mb)
    if out.exists() and not overwrite:
        raise SpecDecError(f"'{out}' exists: pass --overwrite or choose another --out")
    with err.status(f"loading the tokenizer of {target}"):
        model = load_model(target)
    if model.tokenizer is None:
        raise SpecDecError(f"model '{target}' has no tokenizer to tokenize the corpus with")
    tokenizer = model.tokenizer
    columns = (TextColumn("counting n-grams"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("corpus", total=None)
        table = build_ngram_table(
            sources,
            lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"],
            model.vocab_size,
            config,
            {"target": model.name, "tokenizer": getattr(tokenizer, "name_or_path", "")},
            lambda done, total: progress.update(task, completed=done, total=total),
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    Console().print(
        f"{table.meta['tokens']:,} tokens from {len(table.meta['sources'])} file(s) -> {len(table.keys):,} n-grams, "
        f"{out.stat().st_size / 2**20:.1f} MB: {out}  (use --draft ngram:{out})"
    )


def main() -> None:
    app(sys.argv[1:])
