"""Ray Serve deployments that come and go: autoscaling on load, and replicas that cannot start.

Their own module: Serve runs one application per name and one HTTP proxy per cluster, so these deployments
cannot live beside tests/test_ray_serve.py's (module-scoped) one.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(
    folder: Path,  # noqa: F811
    ray_cluster: str,
    driver: None,  # noqa: F811
) -> None:
    server = Server(
        str(folder),
        *["--ray", "--replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1"],
        *["--upscale-delay", "1", "--downscale-delay", "3"],
        *["--ray-address", ray_cluster, "--draft", "prompt-lookup", "--max-batch", "8"],
    )
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


@pytest.mark.slow
def test_replicas_that_cannot_start_are_a_one_line_error(ray_cluster: str) -> None:
    command = [shutil.which("specdec"), "serve", "--ray", "--replicas", "1", "--ray-address", ray_cluster]
    command += ["--target", "/no/such/model", "--port", str(_free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the replicas failed to start: unknown model '/no/such/model'"), last


@pytest.mark.slow
def test_the_serve_config_file_runs_with_serve_run(
    folder: Path,  # noqa: F811
    ray_cluster: str,
    tmp_path: Path,
    driver: None,  # noqa: F811
) -> None:
    """deploy/specdec-serve.yaml as users run it (`serve run`), with this test's model, port and one small replica."""
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "specdec-serve.yaml").read_text())
    port = _free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args.pop("precision")
    args |= {"target": str(folder), "replicas": 1, "max_replicas": 2, "cpus_per_replica": 1, "max_batch": 4}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    command = [shutil.which("serve"), "run", str(tmp_path / "serve.yaml"), "--address", ray_cluster]
    log = tmp_path / "serve-run.log"  # what `serve run` said, for a failure's message
    with log.open("w") as sink:  # the child keeps its own handle
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=_ctrl_c_as_a_shell_has_it)
    url = f"http://127.0.0.1:{port}"
    stopped = True
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        answer = httpx.post(
            f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 0}, timeout=60
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
        assert 'specdec_generated_tokens_total{replica="' in httpx.get(f"{url}/metrics").text
    finally:
        signals = _signal_state(process.pid)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:  # Serve must not outlive the test (its proxy would keep this port)
            process.kill()
            process.wait()
            _shut_serve_down(ray_cluster)
            stopped = False
    said = log.read_text(errors="replace").splitlines()[-15:]
    assert stopped, f"`serve run` did not stop within 120 s of SIGINT ({signals}); its last lines:\n" + "\n".join(said)


def _ctrl_c_as_a_shell_has_it() -> None:
    """SIGINT at its default and unblocked in the child: a disposition inherited from this test process (which
    libraries loaded by earlier tests may have changed) must not decide whether `serve run` hears Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_state(pid: int) -> str:
    """The process's blocked, ignored and caught signal masks, for a failure's message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "no /proc status"
    return ", ".join(line.replace("\t", " ") for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def _shut_serve_down(address: str) -> None:
    """Serve's applications on the cluster shut down from a fresh driver: this process's cached handle may point at a
    controller an earlier test's shutdown killed, and then finds nothing to shut down while `serve run`'s stays."""
    code = "import sys, ray; from ray import serve; ray.init(address=sys.argv[1]); serve.shutdown()"
    subprocess.run([sys.executable, "-c", code, address], check=True, timeout=180, capture_output=True)


@pytest.mark.slow
def test_a_full_deployment_answers_429_like_a_full_server(folder: Path, ray_cluster: str) -> None:  # noqa: F811
    server = Server(
        str(folder),
        *["--ray", "--replicas", "1", "--ray-address", ray_cluster],
        *["--draft", "prompt-lookup", "--max-batch", "1", "--max-queue", "1"],
    )
    body = {"prompt": "abc", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    try:
        # 1 running + 1 waiting in the replica + 1 waiting at the ingress; the rest 429
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda _: httpx.post(f"{server.url}/v1/completions", json=body, timeout=120), range(8))
            )
    finally:
        server.stop()
    statuses = sorted(answer.status_code for answer in answers)
    assert 200 in statuses and 429 in statuses and set(statuses) == {200, 429}, statuses
    refused = next(answer for answer in answers if answer.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"
