"""Scale-out on Ray Serve: a local Ray cluster on loopback that the test starts and stops itself.

Skipped when the ray extra is not installed. The client tests of tests/test_serve.py also run against
a Ray deployment there (its `any_server` fixture); this file tests what only replicas have: routing
over two of them, a replica killed under load, recovery, and the one-line error without Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as Counted
from test_serve import Server, folder  # noqa: F401 - the same tiny chat model folder

from specdec.serving.config import ServeConfig
from specdec.serving.ray_serve import _ingress_app

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_server(folder: Path, ray_cluster: str, driver: None) -> Iterator[Server]:  # noqa: F811
    server = Server(
        str(folder),
        *["--ray", "--replicas", "2", "--ray-address", ray_cluster],
        *["--draft", "prompt-lookup", "--k", "4", "--k-policy", "fixed", "--k-cap", "fixed", "--max-batch", "8"],
    )
    deadline = time.monotonic() + 120  # the ingress answers once one replica is up; wait for both
    while _running() < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def driver(ray_cluster: str) -> Iterator[None]:
    """This test process joined to the cluster, to look at and kill replicas."""
    ray.init(address=ray_cluster, ignore_reinit_error=True)
    yield
    ray.shutdown()


def _replicas() -> list[str]:
    """Names of the live specdec replica actors."""
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::specdec#engine#")
    ]


def _replica_pids() -> list[int]:
    """Process ids of the live specdec replicas (answers name a replica by an opaque id only)."""
    from ray._private.state import actors

    live = [
        a for a in actors().values() if a["Name"].startswith("SERVE_REPLICA::specdec#engine#") and a["State"] == "ALIVE"
    ]
    return [a["Pid"] for a in live]


def _running() -> int:
    from ray import serve

    status = serve.status().applications.get("specdec")
    return 0 if status is None else status.deployments["engine"].replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_two_replicas_share_the_load(ray_server: Server, driver: None) -> None:
    assert _running() == 2
    pids = set()
    for _ in range(20):
        pids.add(httpx.get(f"{ray_server.url}/health").headers.get("x-specdec-replica"))
    assert len(pids) == 2, "requests reach both replicas"


def test_metrics_cover_every_replica(ray_server: Server, driver: None) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    before = ray_server.metric("specdec_generated_tokens_total")
    body = {"prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:  # enough at once that both replicas serve some
        answers = list(
            pool.map(lambda _: httpx.post(f"{ray_server.url}/v1/completions", json=body, timeout=60), range(16))
        )
    served_by = {answer.headers["x-specdec-replica"] for answer in answers}
    assert [answer.status_code for answer in answers] == [200] * 16
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{ray_server.url}/metrics").text)}
    labelled = {s.labels["replica"] for s in families["specdec_generated_tokens"].samples}
    assert len(served_by) == 2 and labelled == served_by, "both replicas' metrics, named as their answers name them"
    assert families["specdec_replicas_reporting"].samples[0].value == 3, "two engine replicas and the ingress"
    assert ray_server.metric("specdec_generated_tokens_total") - before == 16 * 16, (
        "summed over replicas: every token generated"
    )


@pytest.mark.slow
def test_a_killed_replica_loses_no_request_silently_and_the_cluster_recovers(ray_server: Server, driver: None) -> None:
    """SIGKILL a replica under 12 requests (streamed and not): each completes or fails visibly, and is counted."""
    counted_before = {o: ray_server.metric("specdec_replica_failures_total", outcome=o) for o in ("retried", "failed")}

    live: Counter[str] = Counter()  # streams under way (first token received, not yet ended) by replica
    counting = threading.Lock()

    def ask(i: int) -> str:
        body = {
            "prompt": "the cat sat on the mat",
            "max_tokens": 220,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 3 != 0,
        }
        with httpx.stream("POST", f"{ray_server.url}/v1/completions", json=body, timeout=120) as response:
            replica = (
                response.headers.get("x-specdec-replica", "") if body["stream"] and response.status_code == 200 else ""
            )
            lines = []
            for line in response.iter_lines():
                if line and not lines and replica:
                    with counting:
                        live[replica] += 1
                lines += [line] if line else []
            if lines and replica:
                with counting:
                    live[replica] -= 1
        if response.status_code == 503 and "replica_failed" in lines[0]:
            return "failed visibly"  # every replica tried failed before answering
        assert response.status_code == 200, lines
        if not body["stream"] or (lines[-1] == "data: [DONE]" and '"error"' not in lines[-2]):
            return "completed"
        assert '"code": "replica_failed"' in lines[-2] and lines[-1] == "data: [DONE]", (
            f"a stream that neither completed nor said why it ended: {lines[-2:]}"
        )
        return "failed visibly"

    before = set(_replicas())
    with ThreadPoolExecutor(12) as pool:
        outcomes = pool.map(ask, range(12))
        # Kill once both replicas are streaming: requests still in Serve's router would be rerouted unseen.
        deadline = time.monotonic() + 60
        while sum(n > 0 for n in live.values()) < 2:
            assert time.monotonic() < deadline, f"the streams did not reach both replicas: {live}"
            time.sleep(0.05)
        os.kill(_replica_pids()[0], signal.SIGKILL)
        outcomes = list(outcomes)
    counted = {
        o: ray_server.metric("specdec_replica_failures_total", outcome=o) - counted_before[o] for o in counted_before
    }
    assert outcomes.count("completed") + outcomes.count("failed visibly") == 12
    assert outcomes.count("failed visibly") == counted["failed"], "the ingress counts every request it could not save"
    assert counted["retried"] + counted["failed"] >= 1, "the killed replica had requests in flight"
    assert outcomes.count("completed") >= 6, outcomes
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (_running() < 2 or set(_replicas()) == before):
        time.sleep(1)
    assert _running() == 2 and set(_replicas()) != before, "Serve replaces the killed replica"
    answer = ray_server.client.completions.create(
        model=ray_server.client.models.list().data[0].id, prompt="abc", max_tokens=8
    )
    assert answer.choices[0].text is not None


def test_the_serve_config_file_builds_the_application() -> None:
    import yaml
    from ray.serve import Application

    from specdec.serving.ray_serve import app_builder

    config = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "specdec-serve.yaml").read_text())
    entry = config["applications"][0]
    assert entry["import_path"] == "specdec.serving.ray_serve:app_builder"
    assert isinstance(app_builder(entry["args"]), Application)
    with pytest.raises(Exception, match="max_replicas"):
        app_builder({"replicas": 3, "max_replicas": 2})
    with pytest.raises(Exception, match="unknown specdec setting.*colour"):
        app_builder({"colour": "red"})


def test_the_ingress_refuses_before_forwarding_or_reading_a_whole_body() -> None:
    """Keys, Host and the body limit are checked at the ingress: an unauthenticated or oversized request never reaches
    a replica, and a long chunked body is read only to just past the limit (memory stays bounded)."""
    forwarded, read = [], []

    async def send(request):  # a replica that answers {} to anything
        forwarded.append(request)
        headers = [(b"content-type", b"application/json"), (b"x-specdec-replica", b"r1")]
        yield {"type": "http.response.start", "status": 200, "headers": headers}
        yield {"type": "http.response.body", "body": b"{}"}

    failures = Counted("f", "f", ["outcome"], registry=CollectorRegistry())
    app = _ingress_app(send, (), (), failures, ServeConfig(api_keys=("sk-k",), max_request_bytes=1000), "ingress-1")
    key = {"Authorization": "Bearer sk-k"}

    async def long_body():  # a chunked body far over the limit: 1 MB in 100-byte chunks
        for _ in range(10_000):
            read.append(100)
            yield b"x" * 100

    async def run() -> dict[str, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return {
                "no key": await client.post("/v1/completions", json={"prompt": "abc"}),
                "wrong key": await client.post("/v1/completions", json={}, headers={"Authorization": "Bearer x"}),
                "metrics without key": await client.get("/metrics"),
                "rebound host": await client.post("/v1/completions", json={}, headers=key | {"Host": "evil.example"}),
                "too large": await client.post("/v1/completions", content=b"x" * 1001, headers=key),
                "long chunked": await client.post("/v1/completions", content=long_body(), headers=key),
                "fits": await client.post("/v1/completions", content=b"y" * 1000, headers=key),
            }

    answers = asyncio.run(asyncio.wait_for(run(), 30))
    statuses = {
        name: (answer.status_code, answer.json()["error"]["code"]) for name, answer in answers.items() if name != "fits"
    }
    assert statuses == {
        "no key": (401, None),
        "wrong key": (401, "invalid_api_key"),
        "metrics without key": (401, None),
        "rebound host": (403, "host_not_allowed"),
        "too large": (413, "request_too_large"),
        "long chunked": (413, "request_too_large"),
    }
    assert all(
        set(answer.json()["error"]) == {"message", "type", "param", "code"}
        for answer in answers.values()
        if answer.status_code != 200
    )
    assert sum(read) <= 1100, "the long body was read only to just past the limit"
    assert answers["fits"].status_code == 200 and json.loads(answers["fits"].text) == {}
    tags = {name: answer.headers.get_list("x-specdec-replica") for name, answer in answers.items()}
    assert tags == {name: ["r1"] if name == "fits" else ["ingress-1"] for name in answers}, "who answered, once"
    assert [request.body for request in forwarded] == [b"y" * 1000], "only the request within the limits was forwarded"
