"""Scale-out: specdec's server as a Ray Serve application.

Every replica runs the single-process server (serving/app.py: the same routes,
streaming and errors, its own continuous batcher) behind Ray Serve's HTTP
proxy, which sends each request to the replica with fewer requests in flight
of two sampled (Serve's default router) and restarts replicas that die.
GET /metrics, answered by any one replica, gathers every replica's metrics
(Serve's broadcast to the deployment) and labels each sample with its replica.
Ray is an optional extra: ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field

from specdec.config import BatchConfig, GenerationConfig, PrecisionPlan, RayConfig, RuntimeConfig, ServeConfig
from specdec.errors import ConfigError, DeploymentError
from specdec.serving.metrics import Metrics, merge_replicas

DEPLOYMENT = "specdec"
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


def application(spec: ReplicaSpec, ray_config: RayConfig):
    """A Ray Serve application of ``ray_config.replicas`` (to ``max_replicas``) specdec servers."""
    _, serve = require_ray()

    @serve.deployment(
        name=DEPLOYMENT,
        ray_actor_options={"num_cpus": ray_config.cpus_per_replica, "num_gpus": ray_config.gpus_per_replica},
        max_ongoing_requests=spec.serve.max_batch + spec.serve.max_queue,  # beyond this the replica answers 429 itself
        **_scaling(ray_config),
    )
    @serve.ingress()
    class SpecdecReplica:
        """One replica: the single-process server, whose GET /metrics answers for every replica of the deployment."""

        def __init__(self) -> None:
            from specdec.engine import Generator
            from specdec.serving.app import REPLICA, create_app  # imported here: the replica's own host and pid

            generator = Generator(spec.target, spec.draft, spec.generation, spec.runtime, batch=spec.batch)
            generator.batch_decoder()  # measure (or read the cached) batch costs before the first request
            self.name, self.metrics = REPLICA, Metrics()
            self.server = create_app(generator, spec.serve, self.metrics, scrape=self.scrape_all)

        def __serve_build_asgi_app__(self):
            return self.server

        def own_metrics(self) -> tuple[str, bytes]:
            """This replica's name and metrics (called on every replica by whichever one is scraped)."""
            return self.name, self.metrics.render()

        async def scrape_all(self) -> bytes:
            """Every live replica's metrics, labelled by replica; one that does not answer in time is left out (and counted)."""
            context = serve.get_replica_context()
            handle = serve.get_deployment_handle(context.deployment, context.app_name)
            answers = await handle.broadcast("own_metrics").results_async(timeout_s=SCRAPE_TIMEOUT_S, return_exceptions=True)
            return merge_replicas(dict(answer for answer in answers if isinstance(answer, tuple)))

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
        try:
            serve.run(application(spec, ray_config), name=DEPLOYMENT, route_prefix="/")
        except RuntimeError:  # Serve gave up on the replicas: say why in one line, as the replica said it
            raise DeploymentError(f"the replicas failed to start: {_replica_failure(serve)}") from None
        ready()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_failure(serve) -> str:
    """The last line of the failed replicas' error: a specdec error's own message, else the exception line."""
    status = serve.status().applications.get(DEPLOYMENT)
    message = status.deployments[DEPLOYMENT].message if status and DEPLOYMENT in status.deployments else ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "no reason given: see the replica logs under /tmp/ray/session_latest/logs/serve"
    kind, _, text = lines[-1].partition(": ")
    return text if kind.startswith("specdec.errors.") and text else lines[-1]


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
