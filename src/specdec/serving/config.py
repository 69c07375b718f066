"""The server's settings: where it listens, its limits and its keys; Ray Serve's scale-out."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, fields

from specdec.drafters.base import EVERYONE, OWN, HistoryScope
from specdec.errors import ConfigError

SUFFIX_SCOPES = ("auto", "global", "key", "request")
# the suffix drafter's settings, as `specdec serve` names them: set to other values than their defaults, they need a
# drafter that keeps a suffix history
SUFFIX_OPTIONS = {
    "suffix_scope": "--suffix-scope",
    "suffix_max_tokens": "--suffix-max-tokens",
    "suffix_cache": "--suffix-cache",
    "suffix_save_every_s": "--suffix-save-every",
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # host names as host_name() writes them


@dataclass(frozen=True)
class ServeConfig:
    """The HTTP server: where it listens, how many sequences it decodes together, how many requests may wait."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16  # sequences decoded together; more requests wait in the queue
    max_queue: int = 64  # waiting requests; beyond this a request gets 429 with Retry-After
    default_max_tokens: int = 256  # when a request does not say
    shutdown_timeout_s: float = 30.0  # on SIGTERM/SIGINT, how long requests in flight get to finish before they end
    api_keys: tuple[str, ...] = ()  # set: every /v1 route needs `Authorization: Bearer KEY` with one of them
    open_metrics: bool = False  # with keys set, /metrics and the API docs stay open (a scraper without the key)
    max_request_bytes: int = 4 * 2**20  # a larger request body gets a 413 before it is parsed
    # a request whose Host header names none is refused (DNS rebinding); unset on a loopback host: the loopback names
    allowed_hosts: tuple[str, ...] = ()
    header_timeout_s: float = 10.0  # a connection must send a request's headers within this long (else it is cut off)
    body_timeout_s: float = 30.0  # ... and its body within this long after the headers (408 beyond)
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this long
    # the suffix drafter's history of earlier answers: whose it shares (auto: per API key when keys are set, else
    # everyone's; request: none), how many tokens it keeps, and the file that keeps it across restarts
    suffix_scope: str = "auto"
    suffix_max_tokens: int = 1_000_000
    suffix_cache: str | None = None
    suffix_save_every_s: float = 300.0  # the cache is also saved this often while the history changes (0: at stop only)
    # serve on an address beyond loopback without API keys, accepting that anyone who can reach it can use it
    insecure_no_auth: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        object.__setattr__(self, "allowed_hosts", tuple(host_name(h) for h in self.allowed_hosts))
        if any(not key or any(ch.isspace() for ch in key) for key in self.api_keys):
            raise ConfigError("an API key must be a non-empty string without spaces")
        if self.open_beyond_loopback and not self.insecure_no_auth:
            raise ConfigError(
                f"--host {self.host} serves beyond this machine without API keys: set --api-key (or SPECDEC_API_KEYS, "
                "--api-key-file), or pass --insecure-no-auth to accept that anyone who can reach it can use it"
            )
        for name in ("max_batch", "max_queue", "default_max_tokens", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ConfigError(f"unknown suffix scope '{self.suffix_scope}': use one of {', '.join(SUFFIX_SCOPES)}")
        if self.suffix_scope == "key" and not self.api_keys:
            raise ConfigError(
                "--suffix-scope key shares history per API key, and no keys are set: set --api-key, or use global or "
                "request"
            )
        if self.suffix_max_tokens < 0:
            raise ConfigError(f"suffix_max_tokens must be >= 0, got {self.suffix_max_tokens}")
        if self.suffix_save_every_s < 0:
            raise ConfigError(f"suffix_save_every_s must be >= 0 (0: at stop only), got {self.suffix_save_every_s}")
        if "--suffix-save-every" in self.suffix_settings and self.suffix_cache is None:
            raise ConfigError(
                "--suffix-save-every sets how often --suffix-cache is written: add --suffix-cache FILE (without --ray)"
            )
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def open_beyond_loopback(self) -> bool:
        """Whether anyone who can reach the server can use it: it listens beyond loopback and needs no API key."""
        return not self.api_keys and not is_loopback(self.host)

    @property
    def suffix_settings(self) -> tuple[str, ...]:
        """The suffix drafter's settings given other values than their defaults, by their option names."""
        return tuple(
            SUFFIX_OPTIONS[f.name]
            for f in fields(self)
            if f.name in SUFFIX_OPTIONS and getattr(self, f.name) != f.default
        )

    def check_drafter(self, draft: str, concrete: str | None = None) -> None:
        """Refuse suffix settings for a drafter that keeps no suffix history: ``draft`` as given, and ``concrete``, what
        it became on this machine ('auto' is chosen from the machine's costs) once the target is loaded."""
        if not (given := ", ".join(self.suffix_settings)):
            return
        if draft not in ("suffix", "auto"):
            raise ConfigError(f"{given} set(s) the suffix drafter's history: add --draft suffix")
        if concrete is not None and concrete != "suffix":
            raise ConfigError(
                f"{given} set(s) the suffix drafter's history, and 'auto' drafts with {concrete} on this machine: add "
                "--draft suffix"
            )

    @property
    def answered_hosts(self) -> tuple[str, ...]:
        """The names a request's Host header may give (as host_name() writes them; empty: any): ``allowed_hosts``,
        else on a loopback address the loopback names, so that a web page whose DNS name rebinds to 127.0.0.1 cannot
        drive the server from a browser on this machine."""
        if self.allowed_hosts:
            return self.allowed_hosts
        return LOOPBACK if is_loopback(self.host) else ()

    def scope(self, key: str | None) -> HistoryScope:
        """The suffix scope of a request sent with API key ``key`` (DraftSettings.scope): everyone's history, its own
        only, or the group of its key, named by a digest of the key (the key itself is never kept)."""
        kind = self.suffix_scope if self.suffix_scope != "auto" else "key" if self.api_keys else "global"
        if kind == "request":
            return OWN
        if kind == "global" or not key:
            return EVERYONE
        return HistoryScope.of_group(hashlib.sha256(key.encode()).hexdigest()[:32])


def is_loopback(host: str) -> bool:
    """Whether a bind address or host name is this machine's loopback (localhost, 127.0.0.0/8, ::1), in any spelling."""
    name = host_name(host)
    try:
        return name in LOOPBACK or ipaddress.ip_address(name).is_loopback
    except ValueError:  # a name other than localhost
        return False


def host_name(host: str) -> str:
    """A host as the Host allow-list compares it: lower case, without a port, brackets or a trailing dot
    ("[::1]:8000" is "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")]
    elif host.count(":") == 1:
        host = host.rpartition(":")[0]
    return host.rstrip(".")


@dataclass(frozen=True)
class RayConfig:
    """Scale-out on Ray Serve: how many server replicas, how they autoscale, what each one reserves."""

    replicas: int = 2  # the replica count, or the autoscaling minimum when max_replicas is set
    max_replicas: int | None = None  # set: autoscale between replicas and this on requests in flight per replica
    target_ongoing_requests: float = 8.0  # autoscaling aims at this many requests in flight per replica
    upscale_delay_s: float = 30.0  # load must stay above target this long before a replica is added (Serve's default)
    downscale_delay_s: float = 600.0  # ... and below it this long before one is removed (Serve's default)
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    ingress_replicas: int = 1  # the relay in front of the replicas (no CPU reserved); on many nodes, about one per node
    address: str | None = None  # a running Ray cluster ("auto", "ray://host:10001"); None starts one on this machine

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.ingress_replicas < 1:
            raise ConfigError(
                f"replicas and ingress_replicas must be >= 1, got {self.replicas} and {self.ingress_replicas}"
            )
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigError(
                f"max_replicas ({self.max_replicas}) must be >= replicas ({self.replicas}), the autoscaling minimum"
            )
        if self.target_ongoing_requests <= 0 or self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise ConfigError("target_ongoing_requests must be > 0, and cpus/gpus per replica >= 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ConfigError("upscale_delay_s and downscale_delay_s must be >= 0 seconds")
