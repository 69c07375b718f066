"""Ray Serve deployments that come and go: autoscaling on load, and replicas that cannot start.

Their own module: Serve runs one application per name and one HTTP proxy per cluster, so these deployments
cannot live beside tests/test_ray_serve.py's (module-scoped) one.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_ray_serve import _running, driver  # noqa: F401 - the driver fixture joins this process to the cluster
from test_serve import Server, _free_port, folder  # noqa: F401 - the same tiny chat model folder

ray = pytest.importorskip("ray")


def _wait_for(replicas: int, seconds: float) -> float:
    start = time.monotonic()
    while _running() != replicas and time.monotonic() - start < seconds:
        time.sleep(1)
    assert _running() == replicas, f"{_running()} replicas running after {seconds:.0f} s, expected {replicas}"
    return time.monotonic() - start


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(folder: Path, ray_cluster: str, driver: None) -> None:  # noqa: F811
    server = Server(str(folder), "--ray", "--replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1", "--upscale-delay", "1", "--downscale-delay", "3", "--ray-address", ray_cluster, "--draft", "prompt-lookup", "--max-batch", "8")  # fmt: skip
    body = {"prompt": "abc", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    stop, statuses, served_by = threading.Event(), [], set()

    def load() -> None:  # one client asking again as soon as it is answered: 6 of them keep 6 requests in flight
        while not stop.is_set():
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            statuses.append(response.status_code)
            served_by.add(response.headers.get("x-specdec-replica"))

    clients = [threading.Thread(target=load) for _ in range(6)]
    try:
        assert _running() == 1
        for client in clients:
            client.start()
        _wait_for(2, 150)
        time.sleep(5)  # the new replica takes requests
        stop.set()
        for client in clients:
            client.join()
        _wait_for(1, 150)
    finally:
        stop.set()
        server.stop()
    assert statuses and set(statuses) == {200}, "no request failed while the deployment scaled"
    assert len(served_by) == 2, "the added replica served requests"


def test_replicas_that_cannot_start_are_a_one_line_error(ray_cluster: str) -> None:
    command = [shutil.which("specdec"), "serve", "--ray", "--replicas", "1", "--ray-address", ray_cluster, "--target", "/no/such/model", "--port", str(_free_port())]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the replicas failed to start: unknown model '/no/such/model'"), last
