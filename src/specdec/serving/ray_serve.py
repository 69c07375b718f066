"""Scale-out: specdec's server as a Ray Serve application.

Every replica runs the single-process server (serving/app.py: the same routes,
streaming and errors, its own continuous batcher) behind Ray Serve's HTTP
proxy, which sends each request to the replica with fewer requests in flight
of two sampled (Serve's default router) and restarts replicas that die.
Ray is an optional extra: ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field

from specdec.config import BatchConfig, GenerationConfig, PrecisionPlan, RayConfig, RuntimeConfig, ServeConfig
from specdec.errors import ConfigError

DEPLOYMENT = "specdec"


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


def build_server(spec: ReplicaSpec):
    """The ASGI app of one replica (runs on the replica)."""
    from specdec.engine import Generator
    from specdec.serving.app import create_app

    generator = Generator(spec.target, spec.draft, spec.generation, spec.runtime, batch=spec.batch)
    generator.batch_decoder()  # measure (or read the cached) batch costs before the first request
    return create_app(generator, spec.serve)


def application(spec: ReplicaSpec, ray_config: RayConfig):
    """A Ray Serve application of ``ray_config.replicas`` (to ``max_replicas``) specdec servers."""
    _, serve = require_ray()

    @serve.deployment(
        name=DEPLOYMENT,
        ray_actor_options={"num_cpus": ray_config.cpus_per_replica, "num_gpus": ray_config.gpus_per_replica},
        max_ongoing_requests=spec.serve.max_batch + spec.serve.max_queue,  # beyond this the replica answers 429 itself
        **_scaling(ray_config),
    )
    @serve.ingress(lambda: build_server(spec))
    class SpecdecReplica:
        pass

    return SpecdecReplica.bind()


def _scaling(config: RayConfig) -> dict:
    if config.max_replicas is None:
        return {"num_replicas": config.replicas}
    return {
        "autoscaling_config": {
            "min_replicas": config.replicas,
            "max_replicas": config.max_replicas,
            "target_ongoing_requests": config.target_ongoing_requests,
        }
    }


def serve_on_ray(spec: ReplicaSpec, ray_config: RayConfig, ready=lambda: None) -> None:
    """Start (or join) a Ray cluster, run the application on spec.serve's host and port, and block until SIGINT or SIGTERM.

    On either signal Serve shuts down (replicas drain their requests, ServeConfig.drain_s) and
    this process leaves the cluster, so no replica outlives the command on a shared cluster.
    """
    ray, serve = require_ray()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=ray_config.address, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": spec.serve.host, "port": spec.serve.port})
        serve.run(application(spec, ray_config), name=DEPLOYMENT, route_prefix="/")
        ready()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def app_builder(args: dict):
    """Entry point for a Serve config file (``import_path: specdec.serving.ray_serve:app_builder``); ``args`` as in README."""
    spec = ReplicaSpec(
        target=args.get("target", "gemma-3-270m"),
        draft=args.get("draft", "prompt-lookup"),
        runtime=RuntimeConfig(precision=PrecisionPlan.parse(args["precision"]) if args.get("precision") else None),
        serve=ServeConfig(**{k: args[k] for k in ("max_batch", "max_queue", "default_max_tokens") if k in args}),
    )
    ray_keys = ("replicas", "max_replicas", "target_ongoing_requests", "cpus_per_replica", "gpus_per_replica")
    return application(spec, RayConfig(**{k: args[k] for k in ray_keys if k in args}))
