"""The server load benchmark: N concurrent streaming clients for a bounded time, speculation on and off in one run.

Each configuration gets its own `specdec serve` process on loopback (started,
warmed up, measured, stopped with Ctrl-C), so the figures include HTTP,
tokenization and continuous batching exactly as users meet them; by default it
requires an API key that the clients send, as a deployed server would.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts
from specdec.config import DEFAULT_DRAFT
from specdec.errors import ConfigError
from specdec.models import DEFAULT_TARGET


@dataclass(frozen=True)
class LoadConfig:
    prompts: str = DEFAULT_PROMPTS
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    clients: int = 8
    duration_s: float = 60.0
    max_tokens: int = 64
    server_args: tuple[str, ...] = ()  # more `specdec serve` options, the same for both configurations
    keys: bool = True  # the servers require an API key (a fresh one per run) and the clients send it

    def __post_init__(self) -> None:
        if self.clients < 1 or self.duration_s <= 0 or self.max_tokens < 1:
            raise ConfigError("clients, duration and max_tokens must be positive")
        if self.draft == "none":
            raise ConfigError(
                "the load benchmark compares speculation on and off: pass a drafter (--draft prompt-lookup)"
            )


@dataclass
class Outcome:
    latency_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


def run_load_benchmark(config: LoadConfig, say: Callable[[str], None] = print) -> dict:
    prompts = [p.prompt for p in load_prompts(config.prompts)]
    results = {}
    for label, draft in (("speculation off", "none"), (f"speculation on ({config.draft})", config.draft)):
        say(f"{label}: starting the server")
        key = secrets.token_urlsafe(24) if config.keys else None
        with _Server(config.target, draft, config.server_args, key) as url:
            asyncio.run(_load(url, key, prompts[:2], 1, 5, config.max_tokens))  # warm-up: loading, first-request costs
            say(f"{label}: {config.clients} clients for {config.duration_s:.0f} s")
            start = time.perf_counter()
            outcome = asyncio.run(_load(url, key, prompts, config.clients, config.duration_s, config.max_tokens))
            results[label] = _summary(outcome, time.perf_counter() - start)
    return {"config": asdict(config), "results": results}


async def _load(
    url: str, key: str | None, prompts: list[str], clients: int, duration_s: float, max_tokens: int
) -> Outcome:
    outcome = Outcome()
    deadline = time.perf_counter() + duration_s
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:

        async def one_client(index: int) -> None:
            turn = index
            while time.perf_counter() < deadline:
                await _request(client, prompts[turn % len(prompts)], max_tokens, outcome)
                turn += clients

        await asyncio.gather(*(one_client(i) for i in range(clients)))
    return outcome


async def _request(client: httpx.AsyncClient, prompt: str, max_tokens: int, outcome: Outcome) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                outcome.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.errors.append(chunk["error"]["message"])
                    return
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    outcome.tokens += chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        outcome.errors.append(f"{type(exc).__name__}: {exc}")
        return
    outcome.latency_s.append(time.perf_counter() - start)
    outcome.ttft_s.append(first if first is not None else outcome.latency_s[-1])


def _summary(outcome: Outcome, elapsed_s: float) -> dict:
    def percentiles(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p95": None, "p99": None}
        cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}

    return {
        "requests": len(outcome.latency_s),
        "elapsed_s": elapsed_s,
        "requests_per_s": len(outcome.latency_s) / elapsed_s,
        "tokens_per_s": outcome.tokens / elapsed_s,
        "latency_s": percentiles(outcome.latency_s),
        "ttft_s": percentiles(outcome.ttft_s),
        "errors": len(outcome.errors),
        "error_samples": outcome.errors[:5],
    }


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# specdec server load benchmark",
        "",
        f"Target `{cfg['target']}`, {cfg['clients']} concurrent streaming clients for {cfg['duration_s']:.0f} s, "
        f"max_tokens {cfg['max_tokens']}, greedy, prompts from `{cfg['prompts']}`; "
        f"server options: {' '.join(cfg['server_args']) or 'defaults'}; "
        + ("an API key required and sent." if cfg["keys"] else "no API key."),
        "",
        "| configuration | requests | req/s | tokens/s | latency p50 / p95 / p99 s | TTFT p50 / p95 / p99 s | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in report["results"].items():
        lat, ttft = r["latency_s"], r["ttft_s"]
        lines.append(
            f"| {label} | {r['requests']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} "
            f"| {_p(lat)} | {_p(ttft)} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def _p(values: dict) -> str:
    return " / ".join("-" if values[q] is None else f"{values[q]:.2f}" for q in ("p50", "p95", "p99"))


class _Server:
    """`specdec serve` on a free loopback port for the duration of a with-block."""

    def __init__(self, target: str, draft: str, args: tuple[str, ...], key: str | None) -> None:
        self.key = key
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command = [
            shutil.which("specdec") or "specdec",
            "serve",
            "--target",
            target,
            "--draft",
            draft,
            "--port",
            str(self.port),
            *args,
        ]

    def __enter__(self) -> str:
        self.log = tempfile.TemporaryFile("w+")  # a pipe could fill up with access logs and stall the server
        env = os.environ | {"SPECDEC_API_KEYS": self.key or ""}  # from the environment: not on the process list
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise ConfigError(f"the server exited before serving: {self.log.read()[-500:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                time.sleep(0.2)
        self.process.kill()
        raise ConfigError("the server did not start within 10 minutes")

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
