"""Scale-out: specdec's server as a Ray Serve application.

Two deployments. ``engine``: N replicas, each the single-process server
(serving/app.py: the same routes, streaming and errors, its own continuous
batcher), answering requests relayed to it whole. ``ingress``: Serve's HTTP
proxy hands it every request; it checks the request's Host and API key and reads
its body up to ``max_request_bytes`` (as a server does: serving/app.py's Gate),
so that nothing unauthenticated or oversized is held or forwarded, then relays
it to the engine replica with fewer
requests in flight of two sampled (Serve's router) and, when that replica dies
before any of its answer went out, to another (serving/relay.py). GET /metrics
is answered by the ingress for every replica (Serve's broadcast), each sample
labelled with its replica. Serve restarts replicas that die and autoscales the
engine on requests in flight. Ray is an optional extra: ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter

from specdec.config import (
    DEFAULT_DRAFT,
    BatchConfig,
    GenerationConfig,
    PrecisionPlan,
    RuntimeConfig,
)
from specdec.errors import ConfigError, DeploymentError
from specdec.serving.config import RayConfig, ServeConfig
from specdec.serving.metrics import RelayMetrics, merge_replicas
from specdec.serving.relay import Forwarded, call_asgi, relay

if TYPE_CHECKING:
    from specdec.serving.batcher import Batcher

APPLICATION, ENGINE, INGRESS = "specdec", "engine", "ingress"
ATTEMPTS = 3  # replicas a request may be tried on before the client gets a 503
SCRAPE_TIMEOUT_S = 5.0


def require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError('--ray needs Ray Serve: pip install -e ".[ray]"') from None
    return ray, serve


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads: the same typed settings as the single-process server."""

    target: str
    draft: str
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        """Suffix settings need the suffix drafter named: each replica makes 'auto' concrete on its own, and keeps its
        own history (one file cannot hold several)."""
        self.serve.check_drafter(self.draft)
        if self.serve.suffix_settings and self.draft == "auto":
            raise ConfigError(
                f"{', '.join(self.serve.suffix_settings)} set(s) the suffix drafter's history, and with --ray each "
                "replica makes 'auto' concrete on its own: add --draft suffix"
            )
        if self.serve.suffix_cache is not None:
            raise ConfigError("--suffix-cache keeps one server's history: drop it with --ray (replicas keep their own)")


def application(spec: ReplicaSpec, ray_config: RayConfig):
    """A Ray Serve application: an ingress in front of ``ray_config.replicas`` (to ``max_replicas``) specdec servers."""
    ray, serve = require_ray()
    replica_failure = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
    overloaded = (serve.exceptions.BackPressureError,)

    @serve.deployment(
        name=ENGINE,
        ray_actor_options={"num_cpus": ray_config.cpus_per_replica, "num_gpus": ray_config.gpus_per_replica},
        max_ongoing_requests=spec.serve.max_batch + spec.serve.max_queue,  # what one server holds: its batch and queue
        max_queued_requests=spec.serve.max_queue,  # more wait at each ingress; beyond that, 429 (as one full server)
        graceful_shutdown_timeout_s=spec.serve.shutdown_timeout_s,
        **_scaling(ray_config),
    )
    class Engine:
        """One engine replica: the single-process server, run request by request by the ingress."""

        # None until the engine thread starts (Serve may finalize a replica whose __init__ raised).
        batcher: Batcher | None = None

        def __init__(self) -> None:
            from specdec.engine import Generator
            from specdec.models import open_target
            from specdec.serving.app import REPLICA, create_app  # imported here: the replica's own host and pid
            from specdec.serving.suffix import server_drafter

            target = open_target(spec.target, spec.runtime)
            drafter, history = server_drafter(spec.draft, target, spec.serve)  # a suffix history per replica
            generator = Generator(target, drafter, spec.generation, spec.runtime, batch=spec.batch)
            self.name, self.server = REPLICA, create_app(generator, spec.serve, history)
            # The engine thread: the app's lifespan would start it under a server.
            self.batcher = self.server.state.batcher
            self.batcher.start()

        async def forward(self, request: Forwarded) -> AsyncIterator[dict]:
            async for message in call_asgi(self.server, request):
                yield message

        def own_metrics(self) -> tuple[str, bytes]:
            return self.name, self.batcher.metrics.render()

        def check_health(self) -> None:  # Serve calls it periodically and replaces a replica on which it raises
            if not self.batcher.alive:
                raise RuntimeError("the replica's engine thread has stopped")

        # Serve calls it once the replica's requests have drained (or shutdown_timeout_s passed).
        def __del__(self) -> None:
            if self.batcher is not None:
                self.batcher.stop(spec.serve.shutdown_timeout_s)

    @serve.deployment(
        name=INGRESS,
        num_replicas=ray_config.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    @serve.ingress()
    class Ingress:
        """Serve's proxy hands every request here; it is relayed to an engine replica, or answered here (/metrics)."""

        def __init__(self, engine) -> None:
            from specdec.serving.app import REPLICA

            self.name, self.metrics = f"ingress-{REPLICA}", RelayMetrics()
            failures = self.metrics.replica_failures
            self.server = _ingress_app(
                engine.options(stream=True).forward.remote, replica_failure, overloaded, failures, spec.serve, self.name
            )

        def __serve_build_asgi_app__(self) -> FastAPI:
            return self.server

        def own_metrics(self) -> tuple[str, bytes]:
            return self.name, self.metrics.render()

    return Ingress.bind(Engine.bind())


def _ingress_app(
    send: Callable[[Forwarded], AsyncIterator[dict]],
    replica_failure: tuple[type[BaseException], ...],
    overloaded: tuple[type[BaseException], ...],
    failures: Counter,
    config: ServeConfig,
    name: str | None = None,
) -> FastAPI:
    """The ingress's routes behind a server's gate (Host, API keys, the body's size and time limits): GET /metrics for
    every replica of the application; anything else relayed to an engine replica. ``name`` tags what the ingress
    answers itself (refusals, /metrics); relayed answers keep their replica's tag."""
    from ray import serve

    from specdec.serving.app import Gate, openai_errors

    # The engine's docs are relayed.
    app = FastAPI(title="specdec ingress", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, config=config, replica=name)
    openai_errors(app)

    @app.get("/metrics")
    async def metrics() -> Response:
        context = serve.get_replica_context()
        scrapes = [
            serve.get_deployment_handle(deployment, context.app_name)
            .broadcast("own_metrics")
            .results_async(timeout_s=SCRAPE_TIMEOUT_S, return_exceptions=True)
            for deployment in (ENGINE, INGRESS)
        ]
        answers = [answer for answered in await asyncio.gather(*scrapes) for answer in answered]
        # A replica that failed to answer is left out.
        snapshots = dict(answer for answer in answers if isinstance(answer, tuple))
        return Response(merge_replicas(snapshots), media_type=CONTENT_TYPE_LATEST)

    # The replica answers every method.
    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def relayed(request: Request) -> Response:
        return await relay(await Forwarded.of(request), send, replica_failure, ATTEMPTS, failures, overloaded)

    return app


def _scaling(config: RayConfig) -> dict:
    if config.max_replicas is None:
        return {"num_replicas": config.replicas}
    return {
        "autoscaling_config": {
            "min_replicas": config.replicas,
            "max_replicas": config.max_replicas,
            "target_ongoing_requests": config.target_ongoing_requests,
            "upscale_delay_s": config.upscale_delay_s,
            "downscale_delay_s": config.downscale_delay_s,
        }
    }


def serve_on_ray(spec: ReplicaSpec, ray_config: RayConfig, ready=lambda: None) -> None:
    """Start (or join) a Ray cluster, run the application on spec.serve's host and port, block until SIGINT or SIGTERM.

    On either signal Serve shuts down (replicas drain their requests, ServeConfig.shutdown_timeout_s) and
    this process leaves the cluster, so no replica outlives the command on a shared cluster.
    """
    ray, serve = require_ray()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    ray.init(address=ray_config.address, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": spec.serve.host, "port": spec.serve.port})
        try:
            serve.run(application(spec, ray_config), name=APPLICATION, route_prefix="/")
        except RuntimeError:  # Serve gave up on the replicas: say why in one line, as the replica said it
            raise DeploymentError(f"the replicas failed to start: {_replica_failure(serve)}") from None
        ready()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
        for sig, handler in previous.items():  # a caller that embeds this gets its own handlers back
            if handler is not None:  # None: installed outside Python, nothing to put back from here
                signal.signal(sig, handler)


def _replica_failure(serve) -> str:
    """The last line of the failed replicas' error: a specdec error's own message, else the exception line."""
    status = serve.status().applications.get(APPLICATION)
    message = status.deployments[ENGINE].message if status and ENGINE in status.deployments else ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "no reason given: see the replica logs under /tmp/ray/session_latest/logs/serve"
    kind, _, text = lines[-1].partition(": ")
    return text if kind.startswith("specdec.errors.") and text else lines[-1]


def app_builder(args: dict):
    """Entry point for a Serve config file (``import_path: specdec.serving.ray_serve:app_builder``).

    ``args``: target, draft, k, k_policy, dtype, precision, k_cap (or its former name, window), ServeConfig's request
    limits and keys (max_batch, max_queue, default_max_tokens, shutdown_timeout_s, api_keys, open_metrics,
    max_request_bytes, allowed_hosts, suffix_scope, suffix_max_tokens) and RayConfig's fields but the address: the
    settings `specdec serve --ray` takes, by their typed names.
    """
    known = {
        "spec": ("target", "draft"),
        "generation": ("k", "k_policy"),
        "runtime": ("dtype", "precision"),
        "batch": ("k_cap", "window"),
        "serve": (
            "max_batch",
            "max_queue",
            "default_max_tokens",
            "shutdown_timeout_s",
            "api_keys",
            "open_metrics",
            "max_request_bytes",
            "allowed_hosts",
            "suffix_scope",
            "suffix_max_tokens",
        ),
        "ray": tuple(f.name for f in fields(RayConfig) if f.name != "address"),
    }
    unknown = sorted(set(args) - {key for keys in known.values() for key in keys})
    if unknown:
        raise ConfigError(
            f"unknown specdec setting(s) in the Serve config's args: {', '.join(unknown)}; known: {known}"
        )

    def part(name: str) -> dict:
        return {key: args[key] for key in known[name] if key in args}

    runtime = part("runtime")
    if runtime.get("precision"):
        runtime["precision"] = PrecisionPlan.parse(runtime["precision"])
    spec = ReplicaSpec(
        target=args.get("target", "gemma-3-270m"),
        draft=args.get("draft", DEFAULT_DRAFT),
        generation=GenerationConfig(**part("generation")),
        runtime=RuntimeConfig(**runtime),
        batch=BatchConfig(**part("batch")),
        serve=ServeConfig(
            **part("serve") | {name: tuple(args.get(name, ())) for name in ("api_keys", "allowed_hosts")}
        ),
    )
    return application(spec, RayConfig(**part("ray")))
