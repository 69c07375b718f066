"""`specdec serve`: the OpenAI-compatible server, in one process or on Ray Serve."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specdec.cli.options import (
    DRAFT_HELP,
    FAST_BACKEND,
    RUNTIME_ALIAS,
    Branches,
    Dtype,
    KOpt,
    KPolicyOpt,
    NativeFormatOpt,
    ProfileOpt,
    announce_runtime,
    config_from,
    default,
    err,
    runtime_config,
    say,
    status,
    typed_options,
    user_errors,
    with_profile,
)
from specdec.config import DEFAULT_DRAFT, BatchConfig, GenerationConfig, RuntimeConfig
from specdec.errors import ConfigError
from specdec.models import DEFAULT_TARGET
from specdec.serving.config import RayConfig, ServeConfig

if TYPE_CHECKING:
    from specdec.serving.ray_serve import ReplicaSpec

# The options serve alone has; each parameter named as the field of ServeConfig or RayConfig it sets.
ServeTarget = Annotated[
    str, typer.Option("--target", "-t", envvar="SPECDEC_TARGET", help="Bundled alias, model folder or hub id.")
]
ServeDraft = Annotated[str, typer.Option("--draft", "-d", envvar="SPECDEC_DRAFT", help=DRAFT_HELP)]
Host = Annotated[str, typer.Option(envvar="SPECDEC_HOST", help="Address to listen on (0.0.0.0 for every interface).")]
Port = Annotated[int, typer.Option(envvar="SPECDEC_PORT", help="TCP port.")]
KCap = Annotated[
    str,
    typer.Option(
        "--k-cap",
        help="The batch's cap on every row's k: dynamic (chosen each step from the load) or fixed (each row's k "
        "policy alone). --window is its former name, still accepted.",
    ),
]
# --k-cap's former name, an option of its own so that both given can be compared (they must agree)
FormerKCap = Annotated[str | None, typer.Option("--window", hidden=True)]
MaxBatch = Annotated[
    int, typer.Option(envvar="SPECDEC_MAX_BATCH", help="Sequences decoded together; more requests wait.")
]
MaxQueue = Annotated[int, typer.Option(envvar="SPECDEC_MAX_QUEUE", help="Waiting requests before new ones get 429.")]
DefaultMaxTokens = Annotated[int, typer.Option(help="max_tokens when a request does not set it.")]
ShutdownTimeout = Annotated[
    float,
    typer.Option(
        "--shutdown-timeout",
        help="On SIGTERM/SIGINT, seconds requests in flight get to finish; the rest then end with an error "
        "(streams with [DONE]).",
    ),
]
HeaderTimeout = Annotated[
    float,
    typer.Option(
        "--header-timeout",
        help="Seconds a connection has to send a request's headers (slow or silent clients are cut off).",
    ),
]
BodyTimeout = Annotated[
    float,
    typer.Option("--body-timeout", help="Seconds a request's body may take to arrive after its headers (408 beyond)."),
]
KeepAlive = Annotated[float, typer.Option("--keep-alive", help="Seconds an idle keep-alive connection stays open.")]
AllowedHost = Annotated[
    list[str] | None,
    typer.Option(
        "--allowed-host",
        help="Answer only requests whose Host header names this host (repeatable; against DNS rebinding). Without "
        "it, a server on a loopback --host answers only localhost, 127.0.0.1 and [::1].",
    ),
]
ApiKey = Annotated[
    list[str] | None,
    typer.Option(
        help="An API key clients must send as `Authorization: Bearer KEY` (repeatable; also SPECDEC_API_KEYS, "
        "comma-separated)."
    ),
]
MaxRequestBytes = Annotated[int, typer.Option(help="Largest request body accepted (413 beyond it, before parsing).")]
ApiKeyFile = Annotated[Path | None, typer.Option(help="A file of API keys, one per line (# starts a comment).")]
OpenMetrics = Annotated[
    bool, typer.Option(help="With keys set, leave /metrics and the API docs open (for a scraper without the key).")
]
InsecureNoAuth = Annotated[
    bool, typer.Option(help="Serve on a non-loopback address without API keys (anyone who can reach it can use it).")
]
ServeRuntime = Annotated[
    str,
    typer.Option(
        "--runtime",
        "--backend",
        help="Target runtime: native (specdec's CPU runtime), transformers, or auto (native where it runs the "
        "model, else transformers); both batch requests. Deliberately auto, as for generate (the library's default "
        f"is transformers). {RUNTIME_ALIAS}",
    ),
]
ServePrecision = Annotated[
    str | None,
    typer.Option(envvar="SPECDEC_PRECISION", help="Precision plan: a preset or parts (see `specdec generate --help`)."),
]
SuffixScope = Annotated[
    str,
    typer.Option(
        help="With suffix drafting (--draft suffix, or auto where it drafts with suffix): whose earlier answers a "
        "request drafts from: global (everyone's), key (those sent with the same API key), request (none), or auto "
        "(key when API keys are set, else global). Sharing changes speed only, never output, but speed can tell a "
        "user whether others asked alike."
    ),
]
SuffixMaxTokens = Annotated[
    int, typer.Option(help="With suffix drafting: tokens of earlier answers kept (the oldest leave first).")
]
SuffixCache = Annotated[
    Path | None,
    typer.Option(
        help="With suffix drafting: a file the history is loaded from at start and saved to as the server runs "
        "(see --suffix-save-every) and at stop; a damaged one is moved aside and the history starts empty."
    ),
]
SuffixSaveEvery = Annotated[
    float,
    typer.Option(
        "--suffix-save-every",
        help="With --suffix-cache: seconds between saves of the history while it changes (a crash loses at most "
        "this much); 0 saves at stop only.",
    ),
]
Ray = Annotated[
    bool, typer.Option("--ray", help="Run replicas on Ray Serve behind one endpoint (needs the ray extra).")
]
Replicas = Annotated[
    int, typer.Option(envvar="SPECDEC_REPLICAS", help="With --ray: replicas (the autoscaling minimum).")
]
MaxReplicas = Annotated[int | None, typer.Option(help="With --ray: autoscale up to this many replicas on load.")]
TargetOngoingRequests = Annotated[
    float, typer.Option(help="With --ray and --max-replicas: requests in flight per replica to aim at.")
]
UpscaleDelay = Annotated[
    float,
    typer.Option(
        "--upscale-delay", help="With --max-replicas: seconds load stays above target before a replica is added."
    ),
]
DownscaleDelay = Annotated[
    float,
    typer.Option(
        "--downscale-delay", help="With --max-replicas: seconds load stays below target before a replica is removed."
    ),
]
CpusPerReplica = Annotated[float, typer.Option(help="With --ray: CPUs each replica reserves.")]
GpusPerReplica = Annotated[float, typer.Option(help="With --ray: GPUs each replica reserves.")]
IngressReplicas = Annotated[
    int,
    typer.Option(help="With --ray: replicas of the ingress that relays requests (on many nodes, about one per node)."),
]
RayAddress = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        envvar="RAY_ADDRESS",
        help="With --ray: a running cluster (auto, ray://host:10001); default starts one here.",
    ),
]


@user_errors
def serve(
    context: typer.Context,
    target: ServeTarget = DEFAULT_TARGET,
    draft: ServeDraft = DEFAULT_DRAFT,
    host: Host = default(ServeConfig, "host"),
    port: Port = default(ServeConfig, "port"),
    k: KOpt = default(GenerationConfig, "k"),
    k_policy: KPolicyOpt = default(GenerationConfig, "k_policy"),
    branches: Branches = default(GenerationConfig, "branches"),
    k_cap: KCap = default(BatchConfig, "k_cap"),
    former_k_cap: FormerKCap = None,
    max_batch: MaxBatch = default(ServeConfig, "max_batch"),
    max_queue: MaxQueue = default(ServeConfig, "max_queue"),
    default_max_tokens: DefaultMaxTokens = default(ServeConfig, "default_max_tokens"),
    shutdown_timeout_s: ShutdownTimeout = default(ServeConfig, "shutdown_timeout_s"),
    header_timeout_s: HeaderTimeout = default(ServeConfig, "header_timeout_s"),
    body_timeout_s: BodyTimeout = default(ServeConfig, "body_timeout_s"),
    keep_alive_s: KeepAlive = default(ServeConfig, "keep_alive_s"),
    allowed_hosts: AllowedHost = None,
    api_key: ApiKey = None,
    max_request_bytes: MaxRequestBytes = default(ServeConfig, "max_request_bytes"),
    api_key_file: ApiKeyFile = None,
    open_metrics: OpenMetrics = default(ServeConfig, "open_metrics"),
    insecure_no_auth: InsecureNoAuth = default(ServeConfig, "insecure_no_auth"),
    backend: ServeRuntime = FAST_BACKEND,
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
    dtype: Dtype = default(RuntimeConfig, "dtype"),
    precision: ServePrecision = None,
    suffix_scope: SuffixScope = default(ServeConfig, "suffix_scope"),
    suffix_max_tokens: SuffixMaxTokens = default(ServeConfig, "suffix_max_tokens"),
    suffix_cache: SuffixCache = None,
    suffix_save_every_s: SuffixSaveEvery = default(ServeConfig, "suffix_save_every_s"),
    ray: Ray = False,
    replicas: Replicas = default(RayConfig, "replicas"),
    max_replicas: MaxReplicas = default(RayConfig, "max_replicas"),
    target_ongoing_requests: TargetOngoingRequests = default(RayConfig, "target_ongoing_requests"),
    upscale_delay_s: UpscaleDelay = default(RayConfig, "upscale_delay_s"),
    downscale_delay_s: DownscaleDelay = default(RayConfig, "downscale_delay_s"),
    cpus_per_replica: CpusPerReplica = default(RayConfig, "cpus_per_replica"),
    gpus_per_replica: GpusPerReplica = default(RayConfig, "gpus_per_replica"),
    ingress_replicas: IngressReplicas = default(RayConfig, "ingress_replicas"),
    address: RayAddress = default(RayConfig, "address"),
    profile: ProfileOpt = None,
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API with speculative continuous batching."""
    tuned = with_profile(context, profile, target)
    target, draft = tuned.target or target, tuned.draft or draft
    k_cap = tuned.k_cap or given_k_cap(context, k_cap, former_k_cap)
    _refuse_options_of_the_other_mode(context, ray)
    # ServeConfig's and RayConfig's options are read by their fields' names
    server = config_from(
        ServeConfig,
        context,
        api_keys=api_keys(api_key or [], api_key_file),
        allowed_hosts=tuple(allowed_hosts or ()),
        suffix_cache=None if suffix_cache is None else str(suffix_cache),
    )
    if server.open_beyond_loopback:
        say(
            "warning:",
            "yellow",
            f"serving on {host} without API keys (--insecure-no-auth): anyone who can reach it can use it",
        )
    generation = GenerationConfig(
        k=tuned.k or k, k_policy=tuned.k_policy or k_policy, branches=tuned.branches or branches
    )
    runtime = tuned.runtime or runtime_config(backend, dtype, None, None, precision, native_format)
    if runtime.backend == "llama.cpp":
        raise ConfigError(
            "the server runs transformers or native targets (--runtime transformers|native|auto), not llama.cpp"
        )
    batch = BatchConfig(k_cap=k_cap)
    if ray:
        from specdec.serving.ray_serve import ReplicaSpec

        _serve_on_ray(ReplicaSpec(target, draft, generation, runtime, batch, server), config_from(RayConfig, context))
    else:
        _serve_locally(target, draft, generation, runtime, batch, server)


def _serve_locally(
    target: str,
    draft: str,
    generation: GenerationConfig,
    runtime: RuntimeConfig,
    batch: BatchConfig,
    server: ServeConfig,
) -> None:
    """One process: the target, its drafter and the batcher here, on uvicorn until SIGINT or SIGTERM."""
    from specdec import Generator
    from specdec.models import open_target
    from specdec.serving.server import serve as run_server
    from specdec.serving.suffix import server_drafter

    server.check_drafter(draft)
    with status(f"loading {target}" + (f" and {draft}" if draft != "none" else "")):
        opened = open_target(target, runtime)
        announce_runtime(opened)
        drafter, history = server_drafter(draft, opened, server)
        server.check_drafter(draft, "suffix" if history is not None else str(drafter))
        generator = Generator(opened, drafter, generation, runtime, batch=batch)
        generator.batch_decoder(server.max_batch)  # measures this machine's batch costs now, not at the first request
    concrete = "suffix" if history is not None else generator.draft_name
    shown = draft if draft == concrete else f"{draft} ({concrete})"
    err.print(f"serving '{generator.target.name}' with draft '{shown}' on http://{server.host}:{server.port}/v1")
    if history is not None:
        err.print(
            f"suffix history: {history.token_count} tokens"
            + (f", kept in {server.suffix_cache}" if server.suffix_cache else "")
        )
    run_server(generator, server, history)


def _serve_on_ray(spec: ReplicaSpec, ray_config: RayConfig) -> None:
    """Replicas of the server on Ray Serve behind one ingress, until SIGINT or SIGTERM."""
    from specdec.serving.ray_serve import require_ray, serve_on_ray

    require_ray()
    err.print(f"starting {ray_config.replicas} replica(s) of '{spec.target}' with draft '{spec.draft}' on Ray Serve")
    address = f"http://{spec.serve.host}:{spec.serve.port}/v1"
    serve_on_ray(spec, ray_config, ready=lambda: err.print(f"serving on {address} (Ray Serve)"))


def given_k_cap(context: typer.Context, k_cap: str, former: str | None) -> str:
    """--k-cap, or --window (its former name) where that is given; both given must agree (neither is guessed)."""
    if former is None:
        return k_cap
    if typed_options(context, ["k_cap"]) and k_cap != former:
        raise ConfigError(
            f"--k-cap {k_cap} and --window {former} disagree: --window is --k-cap's former name, give --k-cap alone"
        )
    return former


def api_keys(given: list[str], key_file: Path | None) -> tuple[str, ...]:
    """Keys from --api-key, SPECDEC_API_KEYS (comma-separated) and --api-key-file (one per line, # comments), in that
    order."""
    keys = [*given, *os.environ.get("SPECDEC_API_KEYS", "").split(",")]
    if key_file is not None:
        if not key_file.is_file():
            raise ConfigError(f"--api-key-file {key_file} does not exist: pass a file with one key per line")
        keys += [line.split("#", 1)[0] for line in key_file.read_text().splitlines()]
    return tuple(dict.fromkeys(key.strip() for key in keys if key.strip()))


# uvicorn's connection settings: under Ray, Serve's proxy holds the connections (and the ingress reads the body).
PROCESS_OPTIONS = ("header_timeout_s", "body_timeout_s", "keep_alive_s")


def _refuse_options_of_the_other_mode(context: typer.Context, ray: bool) -> None:
    """Options typed on the command line that this mode would ignore: say so (set from the environment, they are)."""
    names, needs = (PROCESS_OPTIONS, "without --ray") if ray else ([f.name for f in fields(RayConfig)], "with --ray")
    typed = typed_options(context, names)
    if typed:
        verb = "applies" if len(typed) == 1 else "apply"
        fix = "drop --ray" if ray else "add --ray"
        raise ConfigError(
            f"{', '.join(typed)} {verb} only {needs}: {fix}, or drop {'it' if len(typed) == 1 else 'them'}"
        )
