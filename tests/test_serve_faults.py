"""What clients get when part of the server fails, in-process (no Ray): the ingress's relay (a request run through
the server's ASGI app, a replica that dies before or while answering) and the engine thread (a failing step, a
thread that stopped)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from conftest import char_tokenizer, loaded, tiny_llama
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from specdec import GenerationConfig, Generator
from specdec.drafters import SuffixDrafter, SuffixStore
from specdec.errors import ConfigError
from specdec.serving import app as app_module
from specdec.serving import server as server_module
from specdec.serving.app import create_app
from specdec.serving.config import LOOPBACK, ServeConfig, is_loopback
from specdec.serving.relay import Forwarded, call_asgi, relay


class ReplicaDied(Exception):
    """Stands in for Ray's actor-died error."""


def _post(path: str, body: dict) -> Forwarded:
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")]
    return Forwarded("POST", path, b"", headers, json.dumps(body).encode())


@pytest.fixture(scope="module")
def server():
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    app = create_app(Generator(target, "prompt-lookup", GenerationConfig(k=4, k_policy="fixed")))
    app.state.batcher.start()
    yield app
    app.state.batcher.stop(5)


async def _all(messages: AsyncIterator[dict]) -> list[dict]:
    return [message async for message in messages]


def test_call_asgi_answers_whole_and_streamed(server) -> None:
    whole = asyncio.run(
        _all(call_asgi(server, _post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0})))
    )
    assert whole[0]["type"] == "http.response.start" and whole[0]["status"] == 200
    assert {m["type"] for m in whole[1:]} == {"http.response.body"} and not whole[-1].get("more_body", False)
    assert json.loads(b"".join(m["body"] for m in whole[1:]))["usage"]["completion_tokens"] == 6
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "stream": True}
    streamed = asyncio.run(_all(call_asgi(server, _post("/v1/completions", body))))
    assert streamed[0]["status"] == 200 and streamed[-1].get("more_body", False) is False
    assert b"data: [DONE]" in b"".join(m.get("body", b"") for m in streamed[1:])
    bad = asyncio.run(_all(call_asgi(server, _post("/v1/completions", {"prompt": [5], "temperature": -1}))))
    assert bad[0]["status"] == 400 and b"temperature" in b"".join(m.get("body", b"") for m in bad[1:])


def test_closing_call_asgi_early_cancels_the_request(server) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}

    async def leave_after_two() -> None:
        messages = call_asgi(server, _post("/v1/completions", body))
        await anext(messages)
        await anext(messages)
        await messages.aclose()  # what the ingress does when its client goes away

    asyncio.run(leave_after_two())
    deadline = time.monotonic() + 10
    while server.state.batcher.load != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.batcher.load == (0, 0)
    assert b"specdec_cancelled_requests_total 1.0" in server.state.batcher.metrics.render()


def _replicas(*behaviours: list):
    """A ``send`` whose n-th call yields behaviours[n]'s messages, raising ReplicaDied where an item is one."""
    calls = iter(behaviours)

    async def send(request: Forwarded) -> AsyncIterator[dict]:
        for item in next(calls):
            if isinstance(item, Exception):
                raise item
            yield item

    return send


STREAM = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
JSON = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}


class Overloaded(Exception):
    """Stands in for Serve's back-pressure error."""


def _relay(send) -> tuple[object, list[bytes], Counter]:
    """The response, the parts of its body as the client would read them, and the failure counts."""
    failures = Counter("f", "f", ["outcome"], registry=CollectorRegistry())

    async def run() -> tuple[object, list[bytes]]:
        response = await relay(_post("/v1/completions", {}), send, (ReplicaDied,), 3, failures, (Overloaded,))
        if isinstance(response, StreamingResponse):
            return response, [part async for part in response.body_iterator]
        return response, [response.body]

    return *asyncio.run(run()), failures


def _count(failures: Counter, outcome: str) -> float:
    return failures.labels(outcome)._value.get()


def test_relay_starts_again_on_another_replica_when_one_dies_before_answering() -> None:
    part = {"type": "http.response.body", "body": b'{"ok": ', "more_body": True}
    end = {"type": "http.response.body", "body": b"true}"}
    response, body, failures = _relay(_replicas([ReplicaDied()], [JSON, part, ReplicaDied()], [JSON, part, end]))
    assert response.status_code == 200 and body == [b'{"ok": true}']
    assert (_count(failures, "retried"), _count(failures, "failed")) == (2, 0)
    stream = [STREAM, ReplicaDied()]  # died before the stream's first event
    response, body, failures = _relay(_replicas(stream, [STREAM, part, end]))
    assert (
        isinstance(response, StreamingResponse) and body == [b'{"ok": ', b"true}"] and _count(failures, "retried") == 1
    )


def test_relay_ends_a_stream_whose_replica_dies_with_an_error_event() -> None:
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    response, body, failures = _relay(_replicas([STREAM, chunk, chunk, ReplicaDied()]))
    assert isinstance(response, StreamingResponse) and body[:2] == [b"data: {}\n\n"] * 2
    error, done = body[-1].decode().strip().split("\n\n")
    assert json.loads(error.removeprefix("data: "))["error"]["code"] == "replica_failed" and done == "data: [DONE]"
    assert (_count(failures, "retried"), _count(failures, "failed")) == (0, 1)


def test_relay_answers_503_when_every_replica_tried_fails() -> None:
    response, body, failures = _relay(_replicas([ReplicaDied()], [ReplicaDied()], [ReplicaDied()]))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(body[0])["error"]["code"] == "replica_failed"
    assert (_count(failures, "retried"), _count(failures, "failed")) == (2, 1)


def test_relay_answers_429_when_every_replica_and_the_queue_are_full() -> None:
    response, body, failures = _relay(_replicas([Overloaded()]))
    error = json.loads(body[0])["error"]
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full"), "as one full server answers"
    assert (_count(failures, "retried"), _count(failures, "failed")) == (0, 0)


def _client(app) -> httpx.AsyncClient:
    """A client of ``app`` in this process, as one on this machine reaches a loopback server."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000")


def _ask(app, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    async def run():
        async with _client(app) as client:
            return await client.request(method, path, json=body, headers=headers, timeout=60)

    return asyncio.run(run())


def _tiny_generator() -> Generator:
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    return Generator(target, "prompt-lookup", GenerationConfig(k=4, k_policy="fixed"))


def _tiny_app(config: ServeConfig = ServeConfig()):
    return create_app(_tiny_generator(), config)


def test_the_library_app_refuses_history_settings_without_a_history(tmp_path: Path) -> None:
    """The serve rules hold for create_app called from Python: settings that size or keep a suffix history need the
    history; the scope, which applies to every request, needs none."""
    for config in (ServeConfig(suffix_max_tokens=1000), ServeConfig(suffix_cache=str(tmp_path / "history"))):
        with pytest.raises(ConfigError, match="create_app was given none: pass history"):
            _tiny_app(config)
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    store = SuffixStore()
    app = create_app(Generator(target, SuffixDrafter(store)), ServeConfig(suffix_scope="request"))
    assert app.state.batcher is not None
    assert create_app(Generator(target, SuffixDrafter(store)), ServeConfig(suffix_max_tokens=1000), store) is not None


# bugs outside the model's step: handing out text, retiring a finished row
@pytest.mark.parametrize("method", ["take", "close"])
def test_a_failing_step_fails_its_request_and_the_engine_goes_on(
    method: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from specdec.engine.generator import Completion

    app = _tiny_app()
    app.state.batcher.start()
    original, calls = getattr(Completion, method), []

    def failing_once(self, *args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("decoding bug")
        return original(self, *args)

    monkeypatch.setattr(Completion, method, failing_once)
    try:
        failed = _ask(app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
        message = failed.json()["error"]["message"]
        assert failed.status_code == 500 and "decoding bug" not in failed.text, "the details go to the log only"
        request_id = re.search(r"request (cmpl-[0-9a-f]{24})", message).group(1)
        assert request_id in caplog.text and "decoding bug" in caplog.text, "the log has them, under the same id"
        answered = _ask(app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 8
        assert _ask(app, "GET", "/health").json()["status"] == "ok"
    finally:
        app.state.batcher.stop(5)


def test_a_stopped_engine_thread_fails_health_and_refuses_requests() -> None:
    app = _tiny_app()
    app.state.batcher._thread = threading.Thread(target=lambda: None)  # an engine thread that has died
    app.state.batcher.start()
    app.state.batcher._thread.join()
    health = _ask(app, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "engine stopped"
    refused = _ask(app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8})
    assert refused.status_code == 503 and "engine thread has stopped" in refused.json()["error"]["message"]


def test_a_bug_in_a_handler_is_a_500_in_openai_shape_and_a_stream_still_ends_with_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whole answers: OpenAI's 500 with the replica header, the traceback only in the log. Streams whose 200 is sent:
    an error event and [DONE]."""
    from specdec.serving import protocol

    app = _tiny_app()
    app.state.batcher.start()

    def broken(*args: object, **kwargs: object) -> dict:
        raise RuntimeError("secret internals")

    try:
        monkeypatch.setattr(protocol, "completion_body", broken)
        failed = _ask(app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert failed.status_code == 500 and failed.headers["x-specdec-replica"]
        assert failed.json()["error"]["type"] == "server_error" and "secret" not in failed.text
        monkeypatch.setattr(protocol, "completion_chunk", broken)
        streamed = _ask(
            app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stream": True}
        )
        events = [line for line in streamed.text.split("\n\n") if line]
        assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_error"
        assert _ask(app, "GET", "/health").json()["status"] == "ok"
    finally:
        app.state.batcher.stop(5)


def _fail_once_full(batcher, running: int, waiting: int) -> None:
    """Make ``batcher``'s decoder step raise once ``running`` requests run and ``waiting`` more wait (until then, steps
    decode nothing), and its ``leave`` raise too: the step's own failure handling fails, and the engine thread dies."""
    decoder = batcher.decoder

    def step() -> list:
        time.sleep(0.01)
        if batcher.load != (running, waiting):
            return []
        raise RuntimeError("secret step internals")

    def leave(completion: object) -> None:
        raise RuntimeError("secret leave internals")

    decoder.step, decoder.leave = step, leave


def test_a_dying_engine_thread_ends_every_request_with_a_generic_error(caplog: pytest.LogCaptureFixture) -> None:
    """4 requests in flight (2 running, 2 queued; 2 streamed, 2 not) when the engine thread dies: each ends within
    seconds, the whole ones with a 500, the streams with an error event and [DONE], none quoting the failure; the
    log has the tracebacks, and the server refuses new requests and says so on /health."""
    app = _tiny_app(ServeConfig(max_batch=2))
    batcher, deaths = app.state.batcher, []
    batcher.on_death = lambda: deaths.append(threading.current_thread().name)
    _fail_once_full(batcher, running=2, waiting=2)
    batcher.start()
    bodies = [{"prompt": [5, 6, 7], "max_tokens": 50, "temperature": 0, "stream": i % 2 == 0} for i in range(4)]

    async def four() -> list[httpx.Response]:
        async with _client(app) as client:
            asks = (client.post("/v1/completions", json=body, timeout=30) for body in bodies)
            return await asyncio.wait_for(asyncio.gather(*asks), 10)

    try:
        answers = asyncio.run(four())
        ids = set()
        for body, answer in zip(bodies, answers, strict=True):
            assert "secret" not in answer.text, answer.text
            if body["stream"]:
                events = [event for event in answer.text.split("\n\n") if event]
                assert answer.status_code == 200 and events[-1] == "data: [DONE]", answer.text
                error = json.loads(events[-2].removeprefix("data: "))["error"]
            else:
                assert answer.status_code == 500, answer.text
                error = answer.json()["error"]
            assert error["type"] == "server_error"
            ids.add(re.search(r"request (cmpl-[0-9a-f]{24})", error["message"]).group(1))
        assert len(ids) == 4, "each answer names its own request"
        assert "secret step internals" in caplog.text and "secret leave internals" in caplog.text
        assert all(request_id in caplog.text for request_id in ids), "the log names the requests it ended"
        assert deaths == ["specdec-engine"]
        assert _ask(app, "GET", "/health").status_code == 503
        refused = _ask(app, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    finally:
        batcher.stop(1)


def test_the_server_exits_with_code_1_after_its_engine_thread_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process a supervisor runs: the request in flight gets its 500, then the server stops and exits with 1."""
    generator = _tiny_generator()
    decoder = generator.batch_decoder()
    monkeypatch.setattr(generator, "batch_decoder", lambda max_rows=None: decoder)
    monkeypatch.setattr(server_module, "_log_to_stderr", lambda: None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exits: list[object] = []

    def run() -> None:
        try:
            server_module.serve(generator, ServeConfig(port=port, shutdown_timeout_s=1))
        except SystemExit as exc:
            exits.append(exc.code)
        else:
            exits.append("returned")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)

    def broken(*args: object) -> None:
        raise RuntimeError("secret internals")

    decoder.step = decoder.leave = broken  # the step fails, and so does its failure handling
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8}, timeout=10)
    assert answer.status_code == 500 and "secret" not in answer.text
    thread.join(30)
    assert exits == [1]


def test_a_waiting_stream_sends_keep_alive_comments(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream queued behind a long step gets SSE comments until its first event, then its usual answer."""
    monkeypatch.setattr(app_module, "HEARTBEAT_S", 0.05)
    app = _tiny_app(ServeConfig(max_batch=1))
    batcher = app.state.batcher
    step, release, seen = batcher.decoder.step, threading.Event(), []

    def slow_step() -> list:
        if not release.is_set():
            release.wait(10)
            seen.append(batcher.load)  # (running, waiting) while the step ran
        return step()

    batcher.decoder.step = slow_step
    batcher.start()
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}

    async def two() -> list[httpx.Response]:
        async with _client(app) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=body, timeout=30))
            while batcher.load != (1, 0):
                await asyncio.sleep(0.01)
            queued = asyncio.create_task(client.post("/v1/completions", json=body | {"stream": True}, timeout=30))
            while batcher.load != (1, 1):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            release.set()
            return await asyncio.gather(first, queued)

    try:
        whole, streamed = asyncio.run(asyncio.wait_for(two(), 20))
    finally:
        release.set()
        batcher.stop(1)
    assert seen == [(1, 1)], "the stream was queued while the first request's step ran"
    events = [event for event in streamed.text.split("\n\n") if event]
    waiting = events[: next(i for i, event in enumerate(events) if event.startswith("data: "))]
    assert len(waiting) >= 3 and set(waiting) == {": keep-alive"}, events[:5]
    # a step slower than the (shortened) heartbeat may put a comment between chunks too: clients skip them
    data = [json.loads(event.removeprefix("data: ")) for event in events[len(waiting) : -1] if event != ": keep-alive"]
    assert events[-1] == "data: [DONE]"
    assert "".join(chunk["choices"][0]["text"] for chunk in data) == whole.json()["choices"][0]["text"]


def test_every_spelling_of_a_loopback_bind_gets_the_loopback_host_check() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "LOCALHOST", "localhost.", "::1", "[::1]"):
        assert is_loopback(host) and ServeConfig(host=host).answered_hosts == LOOPBACK, host
    for host in ("0.0.0.0", "192.168.1.4", "example.com", "::"):
        assert not is_loopback(host), host


@pytest.mark.parametrize(
    ("config", "answered", "refused"),
    [
        # a loopback server without a host list: loopback names only, with or without a port
        (
            ServeConfig(),
            ["127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:8000", "localhost.", "[::1]", "[::1]:8000"],
            ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example", "testserver", ""],
        ),
        # a host list: those names only
        (ServeConfig(allowed_hosts=("llm.example",)), ["llm.example", "LLM.example:443"], ["127.0.0.1", "localhost"]),
        # beyond loopback, without a list: any name (keys guard it)
        (ServeConfig(host="0.0.0.0", api_keys=("sk-k",)), ["10.0.0.7:8000", "llm.example"], []),
    ],
)
def test_the_host_header_is_checked_against_dns_rebinding(
    config: ServeConfig, answered: list[str], refused: list[str]
) -> None:
    app = _tiny_app(config)
    key = {"Authorization": "Bearer sk-k"}
    for host in answered:
        assert _ask(app, "GET", "/v1/models", headers={"Host": host} | key).status_code == 200, host
    for host in refused:
        answer = _ask(app, "GET", "/v1/models", headers={"Host": host} | key)
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "host_not_allowed", host
        assert _ask(app, "GET", "/health", headers={"Host": host}).status_code == 503, "probes stay open (no engine)"
