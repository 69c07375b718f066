"""A soak of `specdec serve`: many clients on loopback for a bounded time, with the traffic a real server meets.

    python benchmarks/soak.py --out benchmarks/results/DATE-cpu-soak.json            # 10 minutes, 32 clients
    python benchmarks/soak.py --duration 60 --clients 8 --out /tmp/soak.json          # a quick look

One `specdec serve` process (the default target and drafter, an API key required) is loaded by ``--clients`` clients
in a loop until ``--duration`` has passed. Each request is drawn (seeded) from: completions and chat, streamed and
not, greedy and sampled; a tenth of them hang up after the first streamed chunk; a tenth are malformed (bad JSON, a
wrong type, an unknown or out-of-range parameter, no key, a body over the size limit), each of which must get a 4xx.

It reports the answers by status, every 5xx, every request still unanswered when its client gave up (a hang), the
server's queue and running batch once the clients have stopped (both must be 0), and the server's resident memory
sampled every 5 s: its level after the first minute (the reference, once the caches have warmed) and at the end.
Exit status 1 if any 5xx, any hang, any request left open, or the end's memory above the reference by more than 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts
from specdec.bench.serve_load import LoadConfig, SpecdecServer
from specdec.config import DEFAULT_DRAFT
from specdec.machine import cpu_name

SAMPLE_EVERY_S = 5.0
REFERENCE_AFTER_S = 60.0
MEMORY_GROWTH = 0.10  # the most the end's resident memory may exceed the reference by
CLIENT_TIMEOUT_S = 300.0  # a request unanswered this long counts as a hang


@dataclass
class Tally:
    statuses: collections.Counter
    kinds: collections.Counter
    server_errors: list[str]
    hangs: list[str]
    wrong: list[str]  # a malformed request that was not refused with a 4xx, or a good one refused


def malformed(rng: random.Random, headers: dict[str, str], limit: int) -> tuple[str, dict, bytes | None, dict | None]:
    """One bad request: (what, headers, raw body or None, JSON body or None)."""
    good = {"prompt": "Hello", "max_tokens": 8}
    cases = [
        ("invalid JSON", headers, b'{"prompt": "Hello", "max_tokens": ', None),
        ("a body that is not an object", headers, b"[1, 2, 3]", None),
        ("max_tokens of the wrong type", headers, None, good | {"max_tokens": "many"}),
        ("negative max_tokens", headers, None, good | {"max_tokens": -5}),
        ("an unknown parameter", headers, None, good | {"frobnicate": True}),
        ("temperature out of range", headers, None, good | {"temperature": 99}),
        ("no API key", {}, None, good),
        ("a wrong API key", {"Authorization": "Bearer wrong"}, None, good),
        ("a body over the size limit", headers, None, good | {"prompt": "x" * (limit + 1)}),
    ]
    return rng.choice(cases)


async def one_request(
    client: httpx.AsyncClient,
    rng: random.Random,
    prompts: list[str],
    headers: dict[str, str],
    tally: Tally,
    limit: int,
    chats: bool,
) -> None:
    roll = rng.random()
    if roll < 0.1:
        what, bad_headers, raw, body = malformed(rng, headers, limit)
        tally.kinds["malformed"] += 1
        try:
            response = await client.post(
                "/v1/completions", content=raw, json=body, headers=bad_headers | {"Content-Type": "application/json"}
            )
        except httpx.TimeoutException:
            tally.hangs.append(what)
            return
        tally.statuses[response.status_code] += 1
        if response.status_code >= 500:
            tally.server_errors.append(f"{what}: {response.status_code} {response.text[:200]}")
        elif not 400 <= response.status_code < 500 or "error" not in response.json():
            tally.wrong.append(f"{what}: {response.status_code} {response.text[:200]}")
        return
    chat = chats and rng.random() < 0.5
    stream = rng.random() < 0.6
    hang_up = stream and roll < 0.2  # a tenth of all requests: streamed, closed after the first chunk
    prompt = rng.choice(prompts)
    body: dict = {"max_tokens": rng.randint(8, 64), "temperature": rng.choice([0.0, 0.0, 0.8]), "stream": stream}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = ("chat" if chat else "completion") + (", hung up" if hang_up else ", streamed" if stream else "")
    tally.kinds[kind] += 1
    try:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                (tally.server_errors if response.status_code >= 500 else tally.wrong).append(f"{kind}: {text}")
                return
            if not stream:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"error"' in line:
                    tally.server_errors.append(f"{kind}: an error event {line[:200]}")
                    return
                if hang_up and line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException:
        tally.hangs.append(kind)
    except httpx.HTTPError as exc:
        tally.server_errors.append(f"{kind}: {type(exc).__name__}: {exc}")


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


async def soak(url: str, headers: dict[str, str], pid: int, args: argparse.Namespace, limit: int) -> dict:
    prompts = [p.prompt for p in load_prompts(args.prompts)]
    tally = Tally(collections.Counter(), collections.Counter(), [], [], [])
    memory: list[tuple[float, int]] = []
    began = time.monotonic()
    deadline = began + args.duration

    async def client_loop(index: int, client: httpx.AsyncClient, chats: bool) -> None:
        rng = random.Random(args.seed * 1000 + index)
        while time.monotonic() < deadline:
            await one_request(client, rng, prompts, headers, tally, limit, chats)

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            memory.append((time.monotonic() - began, resident_bytes(pid)))
            answers = sum(tally.statuses.values())
            print(f"{memory[-1][0]:6.0f} s  {answers:6d} answers  rss {memory[-1][1] / 2**20:.0f} MiB", flush=True)
            await asyncio.sleep(SAMPLE_EVERY_S)

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        probe = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        chats = (await client.post("/v1/chat/completions", json=probe, headers=headers)).status_code == 200
        print("chat requests: " + ("sent" if chats else "not sent (the model has no chat template)"))
        await asyncio.gather(sample_memory(), *(client_loop(i, client, chats) for i in range(args.clients)))
        await asyncio.sleep(2.0)  # hung-up streams: the server notices and frees their rows
        metrics = (await client.get("/metrics", headers=headers)).text
    memory.append((time.monotonic() - began, resident_bytes(pid)))
    gauge = {
        name: float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))
        for name in ("specdec_queue_depth", "specdec_active_sequences")
    }
    reference = next((rss for t, rss in memory if t >= REFERENCE_AFTER_S), memory[0][1])
    return {
        "chat": chats,
        "requests": sum(tally.statuses.values()) + len(tally.hangs),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "kinds": dict(sorted(tally.kinds.items())),
        "server_errors": tally.server_errors,
        "hangs": tally.hangs,
        "wrong_answers": tally.wrong,
        "left_open": gauge,
        "rss_reference_bytes": reference,
        "rss_end_bytes": memory[-1][1],
        "rss_peak_bytes": max(rss for _, rss in memory),
        "rss_end_over_reference": memory[-1][1] / reference,
        "rss_samples": memory,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8, help="the server's running batch")
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    args = parser.parse_args()
    config = LoadConfig(draft=args.draft, clients=(args.clients,), slots=args.max_batch, prompts=args.prompts)
    server = SpecdecServer(config, args.draft)
    limit = 1 << 20  # under the server's own limit for a prompt, over it for the whole body below
    server.command += ["--max-request-bytes", str(limit)]
    with server as url:
        print(f"server up at {url}; {args.clients} clients for {args.duration:.0f} s")
        figures = asyncio.run(soak(url, server.headers(), server.process.pid, args, limit))
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "soak": figures,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    failed = (
        figures["server_errors"]
        or figures["hangs"]
        or figures["wrong_answers"]
        or any(figures["left_open"].values())
        or figures["rss_end_over_reference"] > 1 + MEMORY_GROWTH
    )
    summary = {k: v for k, v in figures.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
