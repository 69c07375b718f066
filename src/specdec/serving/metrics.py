"""The server's Prometheus metrics: traffic, tokens, speculation (acceptance, k) and latency."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from specdec.engine import Completion

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


class Metrics:
    """One registry per server, so that tests and several apps in one process do not share counts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specdec_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(
            "specdec_generated_tokens", "Tokens generated for finished requests", registry=r
        )
        self.proposed = Counter("specdec_draft_tokens_proposed", "Draft tokens the target judged", registry=r)
        self.accepted = Counter("specdec_draft_tokens_accepted", "Draft tokens the target accepted", registry=r)
        self.acceptance = Gauge(
            "specdec_acceptance_rate", "Accepted / proposed draft tokens since the server started", registry=r
        )
        self.k = Histogram("specdec_k", "Draft tokens chosen per sequence per step", buckets=K_BUCKETS, registry=r)
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.active = Gauge("specdec_active_sequences", "Sequences in the running batch", registry=r)
        self.kv_bytes = Gauge("specdec_kv_cache_bytes", "Bytes the running batch's KV caches hold", registry=r)
        self.suffix_tokens = Gauge(
            "specdec_suffix_history_tokens", "Tokens of earlier answers the suffix drafter keeps", registry=r
        )
        self.suffix_bytes = Gauge(
            "specdec_suffix_history_bytes", "Bytes the suffix drafter's history and its index hold", registry=r
        )
        self.cancelled = Counter(
            "specdec_cancelled_requests", "Requests dropped because the client went away", registry=r
        )
        self.latency = Histogram(
            "specdec_request_latency_seconds", "From arrival to the last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds",
            "From arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._totals = [0, 0]  # draft tokens proposed, accepted: the acceptance rate's parts

    def record(self, completion: Completion, latency_s: float, cancelled: bool) -> None:
        """Count a sequence that left the batch."""
        stats = completion.stats
        self.prompt_tokens.inc(len(completion.prompt_ids))
        self.generated_tokens.inc(len(completion.token_ids))
        self.proposed.inc(stats.draft_tokens_proposed)
        self.accepted.inc(stats.draft_tokens_accepted)
        self._totals[0] += stats.draft_tokens_proposed
        self._totals[1] += stats.draft_tokens_accepted
        self.acceptance.set(self._totals[1] / self._totals[0] if self._totals[0] else 0.0)
        for k in stats.k_per_step:
            self.k.observe(k)
        if cancelled:
            self.cancelled.inc()
        else:
            self.latency.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RelayMetrics:
    """The ingress's own count: requests whose replica failed, started again elsewhere
    ("retried") or failed ("failed")."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.replica_failures = Counter(
            "specdec_replica_failures", "Requests whose replica failed, by outcome", ["outcome"], registry=self.registry
        )
        for outcome in ("retried", "failed"):
            self.replica_failures.labels(outcome)  # both series exist from the start, at 0

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_replicas(snapshots: Mapping[str, bytes]) -> bytes:
    """Several replicas' metrics as one exposition: every sample labelled with its replica
    (sum over ``replica`` for totals).

    Also ``specdec_replicas_reporting``: how many replicas the answer covers, so a scrape that missed one shows it.
    """
    families: dict[str, Metric] = {}
    for replica, text in sorted(snapshots.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            merged.samples += [
                sample._replace(labels=sample.labels | {"replica": replica}) for sample in family.samples
            ]
    reporting = GaugeMetricFamily(
        "specdec_replicas_reporting", "Replicas whose metrics this answer includes", value=len(snapshots)
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), reporting]))
    return generate_latest(registry)


class _Families:
    """A prometheus_client collector of ready-made metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families
