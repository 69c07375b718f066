"""How fast a specdec Ray Serve deployment autoscales: load start -> a second replica running; load end -> back to one.

Usage: python benchmarks/ray_autoscaling.py --ray-address HOST:PORT [--out FILE] [-- SERVE_OPTION ...]
Starts `specdec serve --ray --replicas 1 --max-replicas 2` on the cluster with the given serve options
(target, precision, --target-ongoing-requests, --upscale-delay, --downscale-delay, ...), keeps CLIENTS
requests in flight (each client asks again as soon as it is answered) until the second replica runs and
has served 10 s, then stops them, and times both changes from Serve's own status.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import ray
from ray import serve


def running_replicas() -> dict[str, int]:
    return dict(serve.status().applications["specdec"].deployments["engine"].replica_states)


def wait(condition, what: str, timeout_s: float = 900) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--port", type=int, default=8127)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("serve_options", nargs="*")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    command = [
        shutil.which("specdec"),
        "serve",
        "--port",
        str(args.port),
        "--ray",
        "--ray-address",
        args.ray_address,
        "--replicas",
        "1",
        "--max-replicas",
        "2",
        *args.serve_options,
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(lambda: _up(url), "the server answering")
        ray.init(address=args.ray_address, logging_level="ERROR", log_to_driver=False)
        stop, statuses = threading.Event(), []
        body = {
            "prompt": "Write a story about a dog.",
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }

        def client() -> None:
            while not stop.is_set():
                statuses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code)

        clients = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in clients:
            thread.start()
        up_s = wait(lambda: running_replicas().get("RUNNING", 0) == 2, "a second replica")
        time.sleep(10)
        stop.set()
        for thread in clients:
            thread.join()
        down_s = wait(lambda: running_replicas() == {"RUNNING": 1}, "back to one replica")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(120)
    result = {
        "command": command,
        "clients": args.clients,
        "load_start_to_second_replica_running_s": round(up_s, 1),
        "load_end_to_one_replica_s": round(down_s, 1),
        "requests": len(statuses),
        "statuses": sorted(set(statuses)),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
