"""The server load benchmark: concurrent streaming clients for a bounded time, speculation on and off in one run.

Each configuration gets its own server process on loopback (started, warmed up,
loaded at each client count in turn, stopped with Ctrl-C), so the figures include
HTTP, tokenization and continuous batching exactly as users meet them; by default it
requires an API key that the clients send, as a deployed server would. Given a
`llama-server` binary, llama.cpp's own server runs the same GGUF file the same way,
without and with its draft-free n-gram speculation: the server a CPU user would
otherwise run.

Per configuration and client count it reports throughput, latency and TTFT
percentiles, the server's peak resident memory (its high-water mark after that load:
client counts run in increasing order, so the mark is the peak at that count), and
for greedy decoding the share of answers identical to the same server's answer to
the same prompt with speculation off (the reference: target-only, alone or batched).
"""

from __future__ import annotations

import asyncio
import itertools
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
from functools import partial
from pathlib import Path

import httpx

from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts
from specdec.bench.runner import WARM_UP
from specdec.config import DEFAULT_DRAFT
from specdec.drafters import may_learn
from specdec.errors import ConfigError
from specdec.models import DEFAULT_TARGET

LLAMA_SPECULATION = "ngram-simple"  # llama-server's draft-free speculation closest to prompt lookup


@dataclass(frozen=True)
class LoadConfig:
    prompts: str = DEFAULT_PROMPTS
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    clients: tuple[int, ...] = (8,)  # client counts, each loaded in turn against the same server
    duration_s: float = 60.0
    max_tokens: int = 64
    temperature: float = 0.0
    slots: int | None = None  # sequences a server decodes together (--max-batch, llama-server -np); None: most clients
    server_args: tuple[str, ...] = ()  # more `specdec serve` options, the same for both configurations
    keys: bool = True  # the servers require an API key (a fresh one per run) and the clients send it
    llama_server: str | None = None  # llama.cpp's `llama-server` binary: also measured on the target's GGUF file

    def __post_init__(self) -> None:
        if not self.clients or min(self.clients) < 1 or self.duration_s <= 0 or self.max_tokens < 1:
            raise ConfigError("clients, duration and max_tokens must be positive")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be 0 (greedy) or positive, got {self.temperature}")
        if self.slots is not None and self.slots < 1:
            raise ConfigError(f"slots must be a positive integer, got {self.slots}")
        if self.draft == "none":
            raise ConfigError(
                "the load benchmark compares speculation on and off: pass a drafter (--draft prompt-lookup)"
            )
        if self.llama_server is not None and shutil.which(self.llama_server) is None:
            raise ConfigError(
                f"no llama-server at '{self.llama_server}': build it from llama.cpp (cmake --build build "
                "--target llama-server) and pass the path of build/bin/llama-server"
            )
        if "--max-batch" in self.server_args:
            raise ConfigError("pass --slots, not --max-batch in --server-args: it sizes both servers alike")

    @property
    def batch(self) -> int:
        return self.slots or max(self.clients)


@dataclass
class Outcome:
    latency_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    answers: list[tuple[int, str]] = field(default_factory=list)  # (prompt index, text) of each finished request


def run_load_benchmark(config: LoadConfig, say: Callable[[str], None] = print) -> dict:
    from specdec.machine import cpu_name

    prompts = [p.prompt for p in load_prompts(config.prompts)]
    # (server, speculation, how to start one: each start gets a fresh port and key)
    servers: list[tuple[str, str, Callable[[], _Server]]] = [
        ("specdec", "off", partial(SpecdecServer, config, "none")),
        ("specdec", f"on ({config.draft})", partial(SpecdecServer, config, config.draft)),
    ]
    if config.llama_server is not None:
        servers += [
            ("llama-server", "off", partial(_LlamaServer, config, speculation=False)),
            ("llama-server", f"on ({LLAMA_SPECULATION})", partial(_LlamaServer, config, speculation=True)),
        ]
    # A drafter that learns (suffix) would copy answers to prompts sent before: then each client count gets a fresh
    # server and each prompt is sent once.
    learns = may_learn(config.draft)
    runs = []
    for server_name, speculation, start in servers:
        label = f"{server_name}, speculation {speculation}"
        for counts in [[c] for c in sorted(config.clients)] if learns else [sorted(config.clients)]:
            say(f"{label}: starting the server")
            server = start()
            with server as url:
                asyncio.run(_load(server, url, [WARM_UP], 1, 5, config))  # loading, first-request costs
                for clients in counts:
                    say(f"{label}: {clients} clients for {config.duration_s:.0f} s")
                    began = time.perf_counter()
                    outcome = asyncio.run(_load(server, url, prompts, clients, config.duration_s, config, once=learns))
                    figures = _summary(outcome, time.perf_counter() - began) | {"peak_rss_bytes": server.peak_rss()}
                    run = {"server": server_name, "speculation": speculation, "clients": clients}
                    runs.append(run | figures | {"answers": outcome.answers})
    _compare_answers(runs, greedy=config.temperature == 0)
    return {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "config": asdict(config) | {"slots": config.batch},
        "runs": runs,
    }


def _compare_answers(runs: list[dict], greedy: bool) -> None:
    """Set each run's `identical_share` (greedy only): answers equal to the same server's with speculation off.

    The reference for a prompt is the first answer to it with speculation off (fewest clients first).
    """
    reference: dict[tuple[str, int], str] = {}
    for run in runs:
        if run["speculation"] == "off":
            for index, text in run["answers"]:
                reference.setdefault((run["server"], index), text)
    for run in runs:
        keys = [((run["server"], index), text) for index, text in run.pop("answers")]
        compared = [text == reference[key] for key, text in keys if key in reference] if greedy else []
        run["identical_share"] = sum(compared) / len(compared) if compared else None
        run["answers_compared"] = len(compared)


async def _load(
    server: _Server,
    url: str,
    prompts: list[str],
    clients: int,
    duration_s: float,
    config: LoadConfig,
    once: bool = False,
) -> Outcome:
    """``clients`` clients send the prompts in turn until ``duration_s`` has passed (``once``: or every prompt has been
    sent once)."""
    outcome = Outcome()
    deadline = time.perf_counter() + duration_s
    turns = iter(range(len(prompts)) if once else itertools.count())
    async with httpx.AsyncClient(base_url=url, headers=server.headers(), timeout=600) as client:

        async def one_client() -> None:
            while time.perf_counter() < deadline:
                turn = next(turns, None)
                if turn is None:
                    return
                await _request(client, server.body(prompts[turn % len(prompts)], config), turn % len(prompts), outcome)

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return outcome


async def _request(client: httpx.AsyncClient, body: dict, index: int, outcome: Outcome) -> None:
    start = time.perf_counter()
    first = None
    text = []
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
                pieces = [c.get("text") or "" for c in chunk.get("choices", [])]
                if first is None and any(pieces):
                    first = time.perf_counter() - start
                text += pieces
                if chunk.get("usage"):
                    outcome.tokens += chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        outcome.errors.append(f"{type(exc).__name__}: {exc}")
        return
    outcome.latency_s.append(time.perf_counter() - start)
    outcome.ttft_s.append(first if first is not None else outcome.latency_s[-1])
    outcome.answers.append((index, "".join(text)))


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
    cfg, machine = report["config"], report["machine"]
    sampling = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    lines = [
        "# specdec server load benchmark",
        "",
        f"Target `{cfg['target']}`, streaming clients for {cfg['duration_s']:.0f} s per client count, "
        f"max_tokens {cfg['max_tokens']}, {sampling}, prompts from `{cfg['prompts']}`; {cfg['slots']} sequences "
        f"decoded together; specdec options: {' '.join(cfg['server_args']) or 'defaults'}; "
        + ("an API key required and sent." if cfg["keys"] else "no API key."),
        f"Machine: {machine['cpu']}, {machine['cores']} cores.",
        "",
        "vs 1 client: throughput over the same server's with one client (requests one after another). "
        "Identical: share of greedy answers equal to the same server's answer with speculation off.",
        "",
        "| server | speculation | clients | requests | tok/s | vs 1 client | latency p50 / p95 / p99 s "
        "| TTFT p50 / p99 s | peak RSS MiB | identical | errors |",
        "|" + "---|" * 11,
    ]
    for run in report["runs"]:
        solo = _solo(report["runs"], run)
        ratio = f"{run['tokens_per_s'] / solo:.2f}x" if solo else "-"
        identical = "-" if run["identical_share"] is None else f"{run['identical_share']:.0%}"
        lines.append(
            f"| {run['server']} | {run['speculation']} | {run['clients']} | {run['requests']} "
            f"| {run['tokens_per_s']:.1f} | {ratio} | {_p(run['latency_s'], ('p50', 'p95', 'p99'))} "
            f"| {_p(run['ttft_s'], ('p50', 'p99'))} | {run['peak_rss_bytes'] / 2**20:.0f} | {identical} "
            f"| {run['errors']} |"
        )
    return "\n".join(lines) + "\n"


def _solo(runs: list[dict], run: dict) -> float | None:
    """Tokens/s of the same server and speculation with one client, where that was measured."""
    same = [r for r in runs if (r["server"], r["speculation"], r["clients"]) == (run["server"], run["speculation"], 1)]
    return same[0]["tokens_per_s"] if same and same[0]["tokens_per_s"] else None


def _p(values: dict, quantiles: tuple[str, ...]) -> str:
    return " / ".join("-" if values[q] is None else f"{values[q]:.2f}" for q in quantiles)


class _Server:
    """A server process on a free loopback port for the duration of a with-block."""

    health = "/health"

    def __init__(self, config: LoadConfig) -> None:
        self.key = secrets.token_urlsafe(24) if config.keys else None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.command: list[str] = []
        self.env: dict[str, str] = {}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def body(self, prompt: str, config: LoadConfig) -> dict:
        return {
            "prompt": prompt,
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def peak_rss(self) -> int:
        """The process's resident-memory high-water mark (VmHWM) in bytes; 0 where /proc does not say."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return 0
        line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return int(line.split()[1]) * 1024 if line else 0

    def __enter__(self) -> str:
        self.log = tempfile.TemporaryFile("w+")  # a pipe could fill up with access logs and stall the server
        env = os.environ | self.env  # secrets from the environment: not on the process list
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise ConfigError(f"the server exited before serving: {self.log.read()[-500:]}")
            try:
                if httpx.get(f"{url}{self.health}", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
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


class SpecdecServer(_Server):
    def __init__(self, config: LoadConfig, draft: str) -> None:
        super().__init__(config)
        self.command = [shutil.which("specdec") or "specdec", "serve", "--target", config.target, "--draft", draft]
        self.command += ["--port", str(self.port), "--max-batch", str(config.batch), *config.server_args]
        self.env = {"SPECDEC_API_KEYS": self.key or ""}


class _LlamaServer(_Server):
    """llama.cpp's own server on the target's GGUF file: continuous batching, one slot per sequence."""

    def __init__(self, config: LoadConfig, speculation: bool) -> None:
        from specdec.models.target import gguf_path

        super().__init__(config)
        context = 2048 + config.max_tokens  # per slot: the longest prompt of the shipped sets, then the answer
        self.command = [str(config.llama_server), "-m", gguf_path(config.target), "--port", str(self.port)]
        self.command += ["-t", str(os.cpu_count()), "-np", str(config.batch), "-cb", "-c", str(context * config.batch)]
        self.command += ["--spec-type", LLAMA_SPECULATION] if speculation else []
        self.env = {"LLAMA_API_KEY": self.key} if self.key else {}

    def headers(self) -> dict[str, str]:
        # it closes a connection after a streamed answer, so a kept-alive one would fail on reuse
        return super().headers() | {"Connection": "close"}

    def body(self, prompt: str, config: LoadConfig) -> dict:
        # the target's own law when sampling: llama-server otherwise cuts to top-k 40 and min-p 0.05
        return super().body(prompt, config) | {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
