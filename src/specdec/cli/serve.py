"""`specdec serve`: the OpenAI-compatible server, in one process or on Ray Serve."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from specdec.cli.options import (
    DRAFT_HELP,
    FAST_BACKEND,
    Branches,
    Dtype,
    KPolicyOpt,
    NativeFormatOpt,
    ProfileOpt,
    default,
    err,
    runtime_config,
    say,
    status,
    user_errors,
    with_profile,
)
from specdec.config import (
    DEFAULT_DRAFT,
    BatchConfig,
    GenerationConfig,
    RuntimeConfig,
)
from specdec.errors import ConfigError
from specdec.models import DEFAULT_TARGET
from specdec.serving.config import RayConfig, ServeConfig, is_loopback


@user_errors
def serve(
    context: typer.Context,
    target: Annotated[
        str, typer.Option("--target", "-t", envvar="SPECDEC_TARGET", help="Bundled alias, model folder or hub id.")
    ] = DEFAULT_TARGET,
    draft: Annotated[
        str,
        typer.Option(
            "--draft",
            "-d",
            envvar="SPECDEC_DRAFT",
            help=DRAFT_HELP,
        ),
    ] = DEFAULT_DRAFT,
    host: Annotated[
        str, typer.Option(envvar="SPECDEC_HOST", help="Address to listen on (0.0.0.0 for every interface).")
    ] = default(ServeConfig, "host"),
    port: Annotated[int, typer.Option(envvar="SPECDEC_PORT", help="TCP port.")] = default(ServeConfig, "port"),
    k: Annotated[
        int, typer.Option(help="Draft tokens per step (the most per step for an adaptive --k-policy).")
    ] = default(GenerationConfig, "k"),
    k_policy: KPolicyOpt = default(GenerationConfig, "k_policy"),
    branches: Branches = default(GenerationConfig, "branches"),
    window: Annotated[str, typer.Option(help="Batch speculation window: dynamic (capped by load) or fixed.")] = default(
        BatchConfig, "window"
    ),
    max_batch: Annotated[
        int, typer.Option(envvar="SPECDEC_MAX_BATCH", help="Sequences decoded together; more requests wait.")
    ] = default(ServeConfig, "max_batch"),
    max_queue: Annotated[
        int, typer.Option(envvar="SPECDEC_MAX_QUEUE", help="Waiting requests before new ones get 429.")
    ] = default(ServeConfig, "max_queue"),
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request does not set it.")] = default(
        ServeConfig, "default_max_tokens"
    ),
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="On SIGTERM/SIGINT, seconds requests in flight get to finish; the rest then end with an error "
            "(streams with [DONE])."
        ),
    ] = default(ServeConfig, "shutdown_timeout_s"),
    header_timeout: Annotated[
        float,
        typer.Option(help="Seconds a connection has to send a request's headers (slow or silent clients are cut off)."),
    ] = default(ServeConfig, "header_timeout_s"),
    body_timeout: Annotated[
        float, typer.Option(help="Seconds a request's body may take to arrive after its headers (408 beyond).")
    ] = default(ServeConfig, "body_timeout_s"),
    keep_alive: Annotated[float, typer.Option(help="Seconds an idle keep-alive connection stays open.")] = default(
        ServeConfig, "keep_alive_s"
    ),
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            help="Answer only requests whose Host header names this host (repeatable; against DNS rebinding). Without "
            "it, a server on a loopback --host answers only localhost, 127.0.0.1 and [::1]."
        ),
    ] = None,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="An API key clients must send as `Authorization: Bearer KEY` (repeatable; also SPECDEC_API_KEYS, "
            "comma-separated)."
        ),
    ] = None,
    max_request_bytes: Annotated[
        int, typer.Option(help="Largest request body accepted (413 beyond it, before parsing).")
    ] = default(ServeConfig, "max_request_bytes"),
    api_key_file: Annotated[
        Path | None, typer.Option(help="A file of API keys, one per line (# starts a comment).")
    ] = None,
    open_metrics: Annotated[
        bool, typer.Option(help="With keys set, leave /metrics and the API docs open (for a scraper without the key).")
    ] = default(ServeConfig, "open_metrics"),
    insecure_no_auth: Annotated[
        bool,
        typer.Option(help="Serve on a non-loopback address without API keys (anyone who can reach it can use it)."),
    ] = False,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="Target runtime: native (specdec's CPU runtime), transformers, or auto (native where it runs the "
            "model, else transformers); both batch requests. Deliberately auto, as for generate (the library's default "
            "is transformers).",
        ),
    ] = FAST_BACKEND,
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
    dtype: Dtype = default(RuntimeConfig, "dtype"),
    precision: Annotated[
        str | None,
        typer.Option(
            envvar="SPECDEC_PRECISION", help="Precision plan: a preset or parts (see `specdec generate --help`)."
        ),
    ] = None,
    suffix_scope: Annotated[
        str,
        typer.Option(
            help="With suffix drafting (--draft suffix, or auto where it drafts with suffix): whose earlier answers a "
            "request drafts from: global (everyone's), key (those sent with the same API key), request (none), or auto "
            "(key when API keys are set, else global). Sharing changes speed only, never output, but speed can tell a "
            "user whether others asked alike."
        ),
    ] = default(ServeConfig, "suffix_scope"),
    suffix_max_tokens: Annotated[
        int, typer.Option(help="With suffix drafting: tokens of earlier answers kept (the oldest leave first).")
    ] = default(ServeConfig, "suffix_max_tokens"),
    suffix_cache: Annotated[
        Path | None,
        typer.Option(
            help="With suffix drafting: a file the history is loaded from at start and saved to as the server runs "
            "(see --suffix-save-every) and at stop; a damaged one is moved aside and the history starts empty."
        ),
    ] = None,
    suffix_save_every: Annotated[
        float,
        typer.Option(
            help="With --suffix-cache: seconds between saves of the history while it changes (a crash loses at most "
            "this much); 0 saves at stop only."
        ),
    ] = default(ServeConfig, "suffix_save_every_s"),
    ray: Annotated[
        bool, typer.Option("--ray", help="Run replicas on Ray Serve behind one endpoint (needs the ray extra).")
    ] = False,
    replicas: Annotated[
        int, typer.Option(envvar="SPECDEC_REPLICAS", help="With --ray: replicas (the autoscaling minimum).")
    ] = default(RayConfig, "replicas"),
    max_replicas: Annotated[
        int | None, typer.Option(help="With --ray: autoscale up to this many replicas on load.")
    ] = default(RayConfig, "max_replicas"),
    target_ongoing_requests: Annotated[
        float, typer.Option(help="With --ray and --max-replicas: requests in flight per replica to aim at.")
    ] = default(RayConfig, "target_ongoing_requests"),
    upscale_delay: Annotated[
        float, typer.Option(help="With --max-replicas: seconds load stays above target before a replica is added.")
    ] = default(RayConfig, "upscale_delay_s"),
    downscale_delay: Annotated[
        float, typer.Option(help="With --max-replicas: seconds load stays below target before a replica is removed.")
    ] = default(RayConfig, "downscale_delay_s"),
    cpus_per_replica: Annotated[float, typer.Option(help="With --ray: CPUs each replica reserves.")] = default(
        RayConfig, "cpus_per_replica"
    ),
    gpus_per_replica: Annotated[float, typer.Option(help="With --ray: GPUs each replica reserves.")] = default(
        RayConfig, "gpus_per_replica"
    ),
    ingress_replicas: Annotated[
        int,
        typer.Option(
            help="With --ray: replicas of the ingress that relays requests (on many nodes, about one per node)."
        ),
    ] = default(RayConfig, "ingress_replicas"),
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            help="With --ray: a running cluster (auto, ray://host:10001); default starts one here.",
        ),
    ] = default(RayConfig, "address"),
    profile: ProfileOpt = None,
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API with speculative continuous batching."""
    from specdec import Generator
    from specdec.models import open_target
    from specdec.serving.server import serve as run_server
    from specdec.serving.suffix import server_drafter

    options = dict(target=target, draft=draft, k=k, k_policy=k_policy, branches=branches, window=window)
    options = with_profile(
        context, profile, options | dict(backend=backend, dtype=dtype, precision=precision, native_format=native_format)
    )
    target, draft, k, k_policy, branches, window = (
        options[n] for n in ("target", "draft", "k", "k_policy", "branches", "window")
    )
    backend, dtype, precision, native_format = (options[n] for n in ("backend", "dtype", "precision", "native_format"))

    _refuse_options_of_the_other_mode(context, ray)
    keys = api_keys(api_key or [], api_key_file)
    if not keys and not is_loopback(host):
        if not insecure_no_auth:
            raise ConfigError(
                f"--host {host} serves beyond this machine without API keys: set --api-key (or SPECDEC_API_KEYS, "
                "--api-key-file), or pass --insecure-no-auth to accept that anyone who can reach it can use it"
            )
        say(
            "warning:",
            "yellow",
            f"serving on {host} without API keys (--insecure-no-auth): anyone who can reach it can use it",
        )
    serve_config = ServeConfig(
        host=host,
        port=port,
        max_batch=max_batch,
        max_queue=max_queue,
        default_max_tokens=default_max_tokens,
        shutdown_timeout_s=shutdown_timeout,
        api_keys=keys,
        open_metrics=open_metrics,
        max_request_bytes=max_request_bytes,
        allowed_hosts=tuple(allowed_host or ()),
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        keep_alive_s=keep_alive,
        suffix_scope=suffix_scope,
        suffix_max_tokens=suffix_max_tokens,
        suffix_cache=None if suffix_cache is None else str(suffix_cache),
        suffix_save_every_s=suffix_save_every,
    )
    config = GenerationConfig(k=k, k_policy=k_policy, branches=branches)
    if backend == "llama.cpp":
        raise ConfigError(
            "the server runs transformers or native targets (--backend transformers|native|auto), not llama.cpp"
        )
    runtime = runtime_config(backend, dtype, None, None, precision, native_format)
    suffix_options = [
        f"--{name.replace('_', '-')}"
        for name in ("suffix_scope", "suffix_max_tokens", "suffix_cache", "suffix_save_every")
        if context.get_parameter_source(name).name == "COMMANDLINE"
    ]
    if "--suffix-save-every" in suffix_options and suffix_cache is None:
        raise ConfigError(
            "--suffix-save-every sets how often --suffix-cache is written: add --suffix-cache FILE (without --ray)"
        )
    if suffix_options and draft not in ("suffix", "auto"):
        raise ConfigError(f"{', '.join(suffix_options)} set(s) the suffix drafter's history: add --draft suffix")
    if ray:
        if suffix_options and draft == "auto":
            raise ConfigError(
                f"{', '.join(suffix_options)} set(s) the suffix drafter's history, and with --ray each replica makes "
                "'auto' concrete on its own: add --draft suffix"
            )
        if suffix_cache is not None:
            raise ConfigError("--suffix-cache keeps one server's history: drop it with --ray (replicas keep their own)")
        from specdec.serving.config import RayConfig
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
    with status(f"loading {target}" + (f" and {draft}" if draft != "none" else "")):
        opened = open_target(target, runtime)
        drafter, history = server_drafter(draft, opened, serve_config)
        if suffix_options and history is None:
            raise ConfigError(
                f"{', '.join(suffix_options)} set(s) the suffix drafter's history, and 'auto' drafts with {drafter} on "
                "this machine: add --draft suffix"
            )
        generator = Generator(opened, drafter, config, runtime, batch=BatchConfig(window=window))
        generator.batch_decoder()  # measures this machine's batch costs now (cached), not on the first request
    concrete = "suffix" if history is not None else generator.draft_name
    shown = draft if draft == concrete else f"{draft} ({concrete})"
    err.print(f"serving '{generator.target.name}' with draft '{shown}' on http://{host}:{port}/v1")
    if history is not None:
        err.print(
            f"suffix history: {history.token_count} tokens"
            + (f", kept in {serve_config.suffix_cache}" if serve_config.suffix_cache else "")
        )
    run_server(generator, serve_config, history)


def api_keys(given: list[str], key_file: Path | None) -> tuple[str, ...]:
    """Keys from --api-key, SPECDEC_API_KEYS (comma-separated) and --api-key-file (one per line, # comments), in that
    order."""
    keys = [*given, *os.environ.get("SPECDEC_API_KEYS", "").split(",")]
    if key_file is not None:
        if not key_file.is_file():
            raise ConfigError(f"--api-key-file {key_file} does not exist: pass a file with one key per line")
        keys += [line.split("#", 1)[0] for line in key_file.read_text().splitlines()]
    return tuple(dict.fromkeys(key.strip() for key in keys if key.strip()))


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


# uvicorn's connection settings: under Ray, Serve's proxy holds the connections (and the ingress reads the body).
PROCESS_OPTIONS = ("header_timeout", "body_timeout", "keep_alive")


def _refuse_options_of_the_other_mode(context: typer.Context, ray: bool) -> None:
    """Options typed on the command line that this mode would ignore: say so (set from the environment, they are)."""
    names, needs = (PROCESS_OPTIONS, "without --ray") if ray else (RAY_OPTIONS, "with --ray")
    typed = [
        f"--{name.replace('_', '-')}" for name in names if context.get_parameter_source(name).name == "COMMANDLINE"
    ]
    if typed:
        verb = "applies" if len(typed) == 1 else "apply"
        fix = "drop --ray" if ray else "add --ray"
        raise ConfigError(
            f"{', '.join(typed)} {verb} only {needs}: {fix}, or drop {'it' if len(typed) == 1 else 'them'}"
        )
