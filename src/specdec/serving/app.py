"""The OpenAI-compatible HTTP API over the continuous batcher (FastAPI).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(stream: true sends server-sent events in OpenAI's chunk format, ending with
[DONE]), GET /health, GET /metrics (Prometheus). Handlers validate and
encode the request, hand it to the batcher and relay its events; a client
that disconnects cancels its sequence, which leaves the batch before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specdec.config import ServeConfig
from specdec.engine import GenerationResult, Generator
from specdec.errors import SpecDecError
from specdec.serving import protocol as api
from specdec.serving.batcher import Batcher, Job, QueueFullError, ShuttingDownError
from specdec.serving.metrics import Metrics

REPLICA = f"{socket.gethostname()}:{os.getpid()}"  # answers name the process that served them (which replica, behind a proxy)


def create_app(generator: Generator, config: ServeConfig = ServeConfig()) -> FastAPI:
    """An app serving ``generator``'s target under its name; the engine thread (app.state.batcher) runs while the app's lifespan does."""
    metrics = Metrics()
    batcher = Batcher(generator, config.max_batch, config.max_queue, metrics)
    model = generator.target.name

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        yield
        await asyncio.to_thread(batcher.stop, config.drain_s)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.batcher = batcher

    app.add_middleware(
        _Gate, metrics=metrics, keys=config.api_keys, open_metrics=config.open_metrics, max_request_bytes=config.max_request_bytes
    )

    @app.exception_handler(api.APIError)
    async def api_error(request: Request, exc: api.APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(exc))

    @app.get("/health")
    async def health() -> JSONResponse:
        running, waiting = batcher.load
        alive = batcher.alive  # if not, a 503 tells a load balancer (or Serve) to replace this server
        body = {"status": "ok" if alive else "engine stopped", "model": model, "running": running, "waiting": waiting}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        job, prompt_tokens = await _submit(body, body.prompt, "prompt", body.max_tokens)
        rid = api.new_id("cmpl")
        if body.stream:
            chunks = _Chunks(
                lambda text: api.completion_chunk(rid, model, text), lambda finish: api.completion_chunk(rid, model, "", finish)
            )
            return _stream(job, chunks, prompt_tokens, body.stream_options)
        return JSONResponse(api.completion_body(rid, model, await _result(job, request), prompt_tokens))

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest, request: Request) -> Response:
        ids = await asyncio.to_thread(_chat_prompt, body)  # templating and tokenizing take seconds on a long prompt: off the event loop
        job, prompt_tokens = await _submit(body, ids, "messages", body.token_budget)
        rid = api.new_id("chatcmpl")
        if body.stream:
            chunks = _Chunks(
                lambda text: api.chat_chunk(rid, model, {"content": text}),
                lambda finish: api.chat_chunk(rid, model, {}, finish),
                first=api.chat_chunk(rid, model, {"role": "assistant", "content": ""}),
            )
            return _stream(job, chunks, prompt_tokens, body.stream_options)
        return JSONResponse(api.chat_body(rid, model, await _result(job, request), prompt_tokens))

    def _chat_prompt(body: api.ChatRequest) -> list[int]:
        tokenizer = generator.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise api.APIError(400, f"model '{model}' has no chat template: use /v1/completions", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (roles, order)
            raise api.APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None

    async def _submit(body: api.OpenAIRequest, prompt: str | list[int], field: str, budget: int | None) -> tuple[Job, int]:
        body.unsupported()
        if body.model not in (None, model):
            raise api.APIError(
                404, f"The model '{body.model}' does not exist: this server serves '{model}'", param="model", code="model_not_found"
            )
        max_tokens = budget or config.default_max_tokens
        try:
            settings = body.generation_config(generator.config, max_tokens)
        except SpecDecError as exc:  # a sampling, guard or acceptance setting
            raise api.APIError(400, str(exc)) from None
        try:
            completion = await asyncio.to_thread(generator.completion, prompt, settings)  # tokenizing: off the event loop
        except SpecDecError as exc:
            raise api.APIError(400, str(exc), param=field) from None
        used, limit = len(completion.prompt_ids), generator.backend.max_context
        if used + max_tokens > limit:
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens; this request asks for {used + max_tokens} "
                f"({used} in the {field}, {max_tokens} to generate): shorten the {field} or lower max_tokens",
                param=field,
                code="context_length_exceeded",
            )
        job = Job(completion, asyncio.get_running_loop())
        try:
            batcher.submit(job)
        except QueueFullError as exc:
            raise api.APIError(
                429, f"the server is at capacity ({exc}): retry shortly", kind="rate_limit_error", code="queue_full"
            ) from None
        except ShuttingDownError as exc:
            raise api.APIError(503, f"{exc}: retry on another replica", kind="server_error") from None
        return job, used

    return app


DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request asks whether its client is still there
DOCS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that hands the app the body read already, then the connection's own (so disconnects still show)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class _Gate:
    """Every HTTP request passes here: API keys are checked, requests counted by route and status, answers tagged with the replica.

    A plain ASGI middleware (Starlette's ``@app.middleware("http")`` wraps ``receive``): it reads the
    body itself, refusing it past ``max_request_bytes`` (413) before anything parses it, then hands the
    app the body and the connection's own ``receive``, so a handler sees its client's disconnect directly.
    """

    def __init__(self, app: Callable, metrics: Metrics, keys: tuple[str, ...], open_metrics: bool, max_request_bytes: int) -> None:
        self.app, self.metrics, self.keys, self.open_metrics = app, metrics, keys, open_metrics
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def tagged(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-specdec-replica", REPLICA.encode())]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                body = await self._read_body(receive)
                if body is None:
                    refusal = self._too_large_answer()
            if refusal is not None:
                await refusal(scope, receive, tagged)
            else:
                await self.app(scope, _replay(body, receive), tagged)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()

    async def _read_body(self, receive: Callable) -> bytes | None:
        """The whole request body, or None past the limit (also when no Content-Length announced it: chunked)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending: the app will see that at its next receive
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large_answer(self) -> JSONResponse:
        error = api.APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_request_bytes} bytes: shorten the prompt",
            code="request_too_large",
        )
        return JSONResponse(error.body(), status_code=413)

    def _refusal(self, scope: dict) -> JSONResponse | None:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        error = key_refusal(self.keys, self.open_metrics, scope["path"], header)
        return None if error is None else JSONResponse(error.body(), status_code=error.status)


def key_refusal(keys: tuple[str, ...], open_metrics: bool, path: str, authorization: str) -> api.APIError | None:
    """OpenAI's 401 when ``path`` needs a key (keys set: /v1 routes, and /metrics and the docs unless open) and ``authorization`` has none that matches."""
    guarded = path.startswith("/v1/") or (path in DOCS and not open_metrics)
    if not keys or not guarded:
        return None
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() == "bearer" and any(hmac.compare_digest(given.strip().encode(), key.encode()) for key in keys):
        return None
    message = (
        "Incorrect API key provided."
        if authorization
        else "You didn't provide an API key: send it in an Authorization header using Bearer auth (Authorization: Bearer YOUR_KEY)."
    )
    return api.APIError(401, message, code="invalid_api_key" if authorization else None)


class _Chunks:
    """How one endpoint shapes its stream: a chunk per text piece, the closing chunk, an optional opening chunk."""

    def __init__(self, text: Callable[[str], dict], end: Callable[[str], dict], first: dict | None = None) -> None:
        self.text, self.end, self.first = text, end, first


def _stream(job: Job, chunks: _Chunks, prompt_tokens: int, options: api.StreamOptions | None) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            if chunks.first is not None:
                yield _sse(chunks.first)
            while True:
                kind, payload = await job.events.get()
                if kind == "text":
                    yield _sse(chunks.text(payload))
                elif kind == "error":
                    yield _sse(_failure(*payload).body())
                    return
                else:
                    yield _sse(chunks.end(api.FINISH[payload.finish_reason]))
                    if options is not None and options.include_usage:
                        yield _sse(
                            chunks.end(api.FINISH[payload.finish_reason]) | {"choices": [], "usage": api.usage(prompt_tokens, payload)}
                        )
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel()  # the client went away (or the stream ended): nothing more is wanted

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _result(job: Job, request: Request) -> GenerationResult:
    """Wait for the job's end, cancelling it if the client disconnects meanwhile (checked every half second, events or not)."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_CHECK_S
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), timeout=max(check_at - loop.time(), 0.0))
        except asyncio.CancelledError:  # the server dropped the request (its client left): so does the engine
            job.cancel()
            raise
        except TimeoutError:
            kind, payload = None, None
        if kind == "done":
            return payload
        if kind == "error":
            raise _failure(*payload)
        if loop.time() >= check_at:  # text events arrive every step: the check must not wait for a quiet moment
            if await request.is_disconnected():
                job.cancel()
                raise api.APIError(499, "the client closed the request")
            check_at = loop.time() + DISCONNECT_CHECK_S


def _failure(status: int, message: str) -> api.APIError:
    return api.APIError(status, message, kind="server_error" if status >= 500 else "invalid_request_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _validation_error(exc: RequestValidationError) -> api.APIError:
    """The first problem, named the way OpenAI names it."""
    error = exc.errors()[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = location[0] if location else None  # the request field; the message shows the full path
    path = ".".join(location)
    if error.get("type") == "extra_forbidden":
        return api.APIError(400, f"Unrecognized request argument supplied: {path}", param=field)
    if error.get("type") == "json_invalid" or field is None:
        return api.APIError(400, "the request body is not a valid JSON object")
    if error.get("type") == "missing":
        return api.APIError(400, f"'{path}' is required", param=field)
    return api.APIError(400, f"'{path}': {error.get('msg', 'invalid value')} (got {error.get('input')!r})", param=field)
