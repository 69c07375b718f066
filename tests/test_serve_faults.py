"""What clients get when part of the server fails, in-process (no Ray): the ingress's relay (a request run through
the server's ASGI app, a replica that dies before or while answering) and the engine thread (a failing step, a
thread that stopped)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from conftest import char_tokenizer, loaded, tiny_llama
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from specdec import GenerationConfig, Generator
from specdec.serving.app import create_app
from specdec.serving.relay import Forwarded, call_asgi, relay


class ReplicaDied(Exception):
    """Stands in for Ray's actor-died error."""


def _post(path: str, body: dict) -> Forwarded:
    return Forwarded("POST", path, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())


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


def _ask(app, method: str, path: str, body: dict | None = None):
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, json=body, timeout=60)

    return asyncio.run(run())


def _tiny_app():
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    return create_app(Generator(target, "prompt-lookup", GenerationConfig(k=4, k_policy="fixed")))


# bugs outside the model's step: handing out text, retiring a finished row
@pytest.mark.parametrize("method", ["take", "close"])
def test_a_failing_step_fails_its_request_and_the_engine_goes_on(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
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
        assert failed.status_code == 500 and "decoding bug" in failed.json()["error"]["message"]
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
