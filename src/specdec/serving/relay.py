"""Carrying one HTTP request to a server in another process and its answer back, for an ingress that can retry.

The engine side (``call_asgi``) runs a request through the server's ASGI app
in its own process and yields the app's response messages as they are sent,
so streams stay streams. The ingress side (``relay``) sends a request to a
replica through a caller-given ``send`` and answers the client: a replica that
dies before any of its answer has reached the client is replaced by another
(the request starts again there: greedy answers are the same, and seeded ones as docs/usage.md's "What a seed
guarantees" says);
one that dies mid-stream ends the stream with an error event and [DONE], as the
server's own streams end on an error, so that no request is lost silently; when every
replica and the queue before them are full, a 429, as a full server answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter

from specdec.serving import protocol as api

DISCONNECT_GRACE_S = 2.0  # what a request's handler gets to notice its client left before it is cancelled


log = logging.getLogger("specdec.serve")


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as it travels to a replica (picklable)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    @classmethod
    async def of(cls, request: Request) -> Forwarded:
        """``request`` whole; its body is the one the app's Gate read, within ``max_request_bytes``."""
        scope = request.scope
        return cls(scope["method"], scope["path"], scope["query_string"], list(scope["headers"]), await request.body())


async def call_asgi(app: Callable, request: Forwarded) -> AsyncIterator[dict]:
    """Run ``request`` through the ASGI ``app`` here, yielding its ``http.response.*`` messages as it sends them.

    Closing the iterator early (the client left) tells the app its client disconnected, as a server would.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": request.headers,
        "client": None,
        "server": None,
    }
    sent: asyncio.Queue = asyncio.Queue()  # the app's messages, then None once it has returned
    gone = asyncio.Event()
    body = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> dict:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
        task.result()  # the app returned without finishing its answer: raise what it raised
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        task.cancel()


async def relay(
    request: Forwarded,
    send: Callable[[Forwarded], AsyncIterator[dict]],
    replica_failure: tuple[type[BaseException], ...],
    attempts: int,
    failures: Counter,
    overloaded: tuple[type[BaseException], ...] = (),
) -> Response:
    """Answer ``request`` from a replica reached through ``send``, trying another while none of an answer has been sent.

    ``failures`` counts, by outcome, requests started again elsewhere ("retried") and requests failed with their
    replica ("failed").
    ``overloaded``: what ``send`` raises when every replica is full and so is the queue in front of them: a 429, as one
    server answers.
    """
    for attempt in range(1, attempts + 1):
        messages = send(request)
        try:  # a whole answer, or a stream's first event: until then, the request can start again elsewhere
            start = await anext(messages)
            headers = {
                key.decode(): value.decode() for key, value in start["headers"] if key.lower() != b"content-length"
            }
            if headers.get("content-type", "").startswith("text/event-stream"):
                first = await anext(messages)
                return StreamingResponse(_rest(first, messages, replica_failure, failures), start["status"], headers)
            body = b"".join([message.get("body", b"") async for message in messages])
            return Response(body, start["status"], headers)
        except overloaded:
            await _close(messages)
            message = "every replica is at capacity and the queue before them is full: retry shortly"
            return api.APIError(429, message, kind="rate_limit_error", code="queue_full").response()
        except replica_failure:
            await _close(messages)
            if attempt < attempts:
                failures.labels("retried").inc()
            continue
        except BaseException:
            await _close(messages)
            raise
    failures.labels("failed").inc()
    message = f"no replica could answer: {attempts} tried, each failed: retry"
    return api.APIError(503, message, code="replica_failed").response()


async def _rest(
    first: dict, messages: AsyncIterator[dict], replica_failure: tuple[type[BaseException], ...], failures: Counter
) -> AsyncIterator[bytes]:
    try:
        yield first.get("body", b"")
        async for message in messages:
            yield message.get("body", b"")
    except replica_failure:
        failures.labels("failed").inc()
        error = api.APIError(503, "the replica serving this stream failed: retry the request", code="replica_failed")
        yield api.stream_error(error).encode()
    except Exception:  # anything else the replica raised mid-stream: the stream still ends in its protocol
        log.exception("a relayed stream failed")
        yield api.stream_error(api.INTERNAL_ERROR).encode()
    finally:
        await _close(messages)


async def _close(messages: AsyncIterator[dict]) -> None:
    close = getattr(messages, "aclose", None) or getattr(messages, "cancel", None)
    if close is not None:
        with contextlib.suppress(BaseException):
            result = close()
            if asyncio.iscoroutine(result):
                await result
