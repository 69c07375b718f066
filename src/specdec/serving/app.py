"""The OpenAI-compatible HTTP API over the continuous batcher (FastAPI).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(stream: true sends server-sent events in OpenAI's chunk format, ending with
[DONE]), GET /health, GET /metrics (Prometheus). Handlers validate and
encode the request, hand it to the batcher and relay its events; a client
that disconnects cancels its sequence, which leaves the batch before the next step.
A stream sends an SSE comment (": keep-alive") while it waits for its next event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter
from starlette.exceptions import HTTPException

from specdec.drafters import SuffixStore
from specdec.engine import GenerationResult, Generator
from specdec.errors import ConfigError, ContextLengthError, SpecDecError
from specdec.serving import protocol as api
from specdec.serving.batcher import Batcher, Job, MemoryFullError, QueueFullError, ShuttingDownError
from specdec.serving.config import SUFFIX_OPTIONS, ServeConfig, host_name
from specdec.serving.metrics import Metrics
from specdec.serving.suffix import HistoryKeeper

log = logging.getLogger("specdec.serve")

# Answers name the process that served them (which replica, behind a proxy) by an opaque id; the log maps it to
# host and pid.
REPLICA = uuid.uuid4().hex[:12]


def create_app(
    generator: Generator, config: ServeConfig = ServeConfig(), history: SuffixStore | None = None
) -> FastAPI:
    """An app serving ``generator``'s target under its name; the engine thread (app.state.batcher) runs while the app's
    lifespan does. ``history``: the suffix drafter's store, reported in /metrics and saved to ``config.suffix_cache``
    while the app runs (every ``config.suffix_save_every_s``) and when it stops; ConfigError where ``config`` sizes or
    keeps a suffix history and none is given."""
    kept = [name for name in config.suffix_settings if name != SUFFIX_OPTIONS["suffix_scope"]]
    if kept and history is None:
        raise ConfigError(
            f"{', '.join(kept)} size(s) or keep(s) the suffix drafter's history, and create_app was given none: pass "
            "history (the SuffixStore the generator's SuffixDrafter drafts from), or leave them at their defaults"
        )
    metrics = Metrics()
    batcher = Batcher(generator, config.max_batch, config.max_queue, metrics)
    scoring = asyncio.Semaphore(1)  # prompts scored for echo: one forward at a time beside the engine thread
    model = generator.target.name

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        log.info("replica %s: pid %d on %s", REPLICA, os.getpid(), socket.gethostname())  # answers name only the id
        keeper = None
        if history is not None and config.suffix_cache is not None:
            keeper = HistoryKeeper(history, config.suffix_cache, model, config.suffix_save_every_s)
            keeper.start()
        yield
        await asyncio.to_thread(batcher.stop, config.shutdown_timeout_s)
        if keeper is not None:
            await keeper.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.batcher = batcher

    app.add_middleware(Gate, config=config, requests=metrics.requests, replica=REPLICA)

    openai_errors(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        running, waiting = batcher.load
        alive = batcher.alive  # if not, a 503 tells a load balancer (or Serve) to replace this server
        body = {"status": "ok" if alive else "engine stopped", "model": model, "running": running, "waiting": waiting}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if history is not None:
            metrics.suffix_tokens.set(history.token_count)
            metrics.suffix_bytes.set(history.nbytes)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": model, "object": "model", "created": 0, "owned_by": "specdec"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> dict:
        _check_model(name)
        return card

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        _check_request(body)
        rid = api.new_id("cmpl")
        # each prompt's n answers in OpenAI's order; every job is submitted before any is awaited (one batch)
        asked = [(prompt, choice) for prompt in body.prompts for choice in range(body.n)]
        jobs: list[Job | None] = [None] * len(asked)
        streaming = False
        try:
            if body.max_tokens != 0:
                for p, prompt in enumerate(body.prompts):
                    ids = [f"{rid}-{p * body.n + choice}" for choice in range(body.n)]
                    jobs[p * body.n : (p + 1) * body.n] = await _submit(
                        body, prompt, "prompt", body.max_tokens, request, ids
                    )
            if body.stream:
                choices, prompt_tokens = [], 0
                for i, (prompt, choice) in enumerate(asked):
                    ids, text, scored = await _echoed(body, prompt, jobs[i])
                    prompt_tokens += len(ids) if choice == 0 else 0
                    chunk = _completion_chunks(rid, i, 0 if body.echo else len(text), body.logprobs is not None)
                    opening = [chunk(text, ids, scored, None)] if body.echo else []
                    choices.append(_Choice(jobs[i], opening, chunk))
                usage = _usage_chunk(rid, "text_completion", prompt_tokens, body.stream_options)
                streaming = True
                return _stream(choices, batcher, usage)
            answers, used = [], [0, 0]
            for i, (prompt, choice) in enumerate(asked):
                answers.append(await _answer(body, prompt, jobs[i], request, used, choice == 0))
        finally:
            for job in jobs if not streaming else ():
                if job is not None:
                    job.cancel()  # a no-op for a finished job; the rest when a later prompt failed
        usage = api.usage(used[0], used[1])
        return JSONResponse(api.completion_body(rid, model, answers, spell, usage))

    def _completion_chunks(rid: str, index: int, offset: int, reported: bool) -> _ChunkOf:
        """How choice ``index`` of a completions stream becomes chunks; ``offset``: where its first token's text
        starts (after the prompt, or 0 where the prompt is echoed); ``reported``: logprobs asked for."""
        at = offset

        def chunk(text: str, tokens: list[int], entries: list | None, finish: str | None) -> dict:
            nonlocal at
            logprobs = None
            if reported:
                logprobs = api.completion_logprobs(tokens, entries or [], spell, at)
                at += sum(len(token) for token in logprobs["tokens"])
            return api.completion_chunk(rid, model, text, finish, index, logprobs)

        return chunk

    def _usage_chunk(rid: str, kind: str, prompt_tokens: int, options: api.StreamOptions | None) -> _UsageOf | None:
        if options is None or not options.include_usage:
            return None
        return lambda generated: api.usage_chunk(rid, kind, model, api.usage(prompt_tokens, generated))

    async def _echoed(
        body: api.CompletionRequest, prompt: str | list[int], job: Job | None
    ) -> tuple[list[int], str, list | None]:
        """The prompt's token ids, its text, and where echo and logprobs ask for them its tokens' scores (None
        otherwise; the first token's is None)."""
        ids = job.completion.prompt_ids if job is not None else await _encode(generator.encode, prompt, "prompt")
        text = prompt if isinstance(prompt, str) else await asyncio.to_thread(_text, ids)
        if not body.echo or body.logprobs is None:
            return ids, text, None
        async with scoring:  # one prompt scored at a time, beside the engine thread
            return ids, text, await asyncio.to_thread(generator.score, ids, body.logprobs)

    async def _answer(
        body: api.CompletionRequest,
        prompt: str | list[int],
        job: Job | None,
        request: Request,
        used: list[int],
        first: bool,
    ) -> api.Answer:
        """One choice: its job's result (none with max_tokens 0), led by the prompt and its scores when echoed.
        ``used`` counts prompt tokens (once per prompt: at its ``first`` answer) and completion tokens."""
        ids, prompt_text, scored = await _echoed(body, prompt, job)
        result = await _result(job, batcher, request) if job is not None else None
        tokens, entries = (result.token_ids, result.logprobs) if result is not None else ([], [])
        text, finish = (result.text, api.FINISH[result.finish_reason]) if result is not None else ("", "length")
        used[0] += len(ids) if first else 0
        used[1] += len(tokens)
        if not body.echo:
            return api.Answer(text, finish, tokens, entries if body.logprobs is not None else None, len(prompt_text))
        if scored is not None:
            scored += entries or []
        return api.Answer(prompt_text + text, finish, ids + tokens, scored, 0)

    def _text(ids: list[int]) -> str:
        return generator.tokenizer.decode(ids) if generator.tokenizer is not None else ""

    def spell(token: int) -> str:
        """A token's text, as log-probabilities name it."""
        return generator.tokenizer.decode([token]) if generator.tokenizer is not None else str(token)

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest, request: Request) -> Response:
        _check_request(body)
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        # Templating and tokenizing take seconds on a long prompt: off the event loop.
        ids = await _encode(lambda m: generator.chat_ids(m, body.offered), messages, "messages")
        rid = api.new_id("chatcmpl")
        jobs: list[Job] = []
        streaming = False
        try:  # the answers (n of them), each its own sequence and seed, decoded in the same batch
            rids = [f"{rid}-{choice}" for choice in range(body.n)]
            jobs += await _submit(body, ids, "messages", body.token_budget, request, rids)
            if body.stream:
                choices = [
                    _Choice(
                        job,
                        [api.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, i)],
                        _chat_chunks(rid, i, body.logprobs, body.tool_call if body.offered else None),
                    )
                    for i, job in enumerate(jobs)
                ]
                usage = _usage_chunk(rid, "chat.completion.chunk", len(ids), body.stream_options)
                streaming = True
                return _stream(choices, batcher, usage)
            results = [await _result(each, batcher, request) for each in jobs]
        finally:
            for each in jobs if not streaming else ():
                each.cancel()
        return JSONResponse(api.chat_body(rid, model, results, len(ids), spell, body.tool_call))

    def _chat_chunks(rid: str, index: int, reported: bool, call: Callable[[str], dict | None] | None) -> _ChunkOf:
        """How choice ``index`` of a chat stream becomes chunks; ``reported``: logprobs asked for. Where tools are
        offered (``call`` reads a tool call from an answer), the answer is held to its end and sent in one chunk, as
        a tool call or as words."""
        held: list[tuple[str, list]] = []

        def chunk(text: str, tokens: list[int], entries: list | None, finish: str | None) -> dict | None:
            if call is not None:
                held.append((text, entries or []))
                if finish is None:
                    return None
                text, entries = "".join(t for t, _ in held), [e for _, each in held for e in each]
                made = call(text)
                if made is not None:
                    return api.chat_chunk(
                        rid,
                        model,
                        {"tool_calls": [{"index": 0} | made]},
                        "tool_calls",
                        index,
                        api.chat_logprobs(entries, spell) if reported else None,
                    )
            logprobs = api.chat_logprobs(entries or [], spell) if reported else None
            return api.chat_chunk(rid, model, {"content": text} if text else {}, finish, index, logprobs)

        return chunk

    def _check_model(name: str | None) -> None:
        if name not in (None, model):
            raise api.APIError(
                404,
                f"The model {api.excerpt(name)} does not exist: this server serves '{model}'",
                param="model",
                code="model_not_found",
            )

    def _check_request(body: api.OpenAIRequest) -> None:
        """What can be refused before any work: another model, options this server does not implement."""
        _check_model(body.model)
        body.unsupported()

    async def _encode(encode: Callable, prompt: object, field: str) -> object:
        """``encode(prompt)`` off the event loop; a prompt the engine refuses is a 400 naming ``field``."""
        try:
            return await asyncio.to_thread(encode, prompt)
        except ContextLengthError as exc:
            raise api.APIError(400, str(exc), param=field, code="context_length_exceeded") from None
        # An empty or malformed prompt, a setting this model cannot honour (stop strings without a tokenizer).
        except SpecDecError as exc:
            raise api.APIError(400, str(exc), param=field) from None

    async def _submit(
        body: api.OpenAIRequest,
        prompt: str | list[int],
        field: str,
        budget: int | None,
        request: Request,
        rids: list[str],
    ) -> list[Job]:
        """The request's answers to ``prompt`` (choice i under request id ``rids[i]``), encoded once and submitted
        together: they join the batch at one step, where the decoder reads their prompt once."""
        max_tokens = budget or config.default_max_tokens
        if len(rids) > config.max_batch + config.max_queue:  # a request the server could never take at once
            raise api.APIError(
                400,
                f"{len(rids)} answers to one prompt exceed what this server takes at once ({config.max_batch} running "
                f"and {config.max_queue} waiting): ask for fewer with n",
                param="n",
            )
        try:
            every = [body.generation_config(generator.config, max_tokens, choice) for choice in range(len(rids))]
        except SpecDecError as exc:  # a sampling, guard or acceptance setting
            raise api.APIError(400, str(exc)) from None
        settings = every[0]
        try:
            generator.check_sampling(settings.sampling)
        except SpecDecError as exc:
            raise api.APIError(400, str(exc), param="logit_bias") from None
        if settings.grammar is not None:  # compiled here too, so that a schema that does not compile is named as such
            try:
                await asyncio.to_thread(generator.grammars.constraint, settings.grammar)
            except SpecDecError as exc:
                named = "grammar" if body.grammar else "response_format" if body.response_format else "tools"
                raise api.APIError(400, str(exc), param=named) from None
        completion = await _encode(lambda p: generator.completion(p, settings), prompt, field)
        used, limit = len(completion.prompt_ids), generator.backend.max_context
        if used + max_tokens > limit:
            raise api.APIError(
                400,
                f"This model's maximum context length is {limit} tokens; this request asks for {used + max_tokens} "
                f"({used} in the {field}, {max_tokens} to generate): shorten the {field} or lower max_tokens",
                param=field,
                code="context_length_exceeded",
            )
        others: list = []
        if every[1:]:  # the other answers' sequences, from the ids already encoded
            ids = completion.prompt_ids
            others = await _encode(lambda settings: [generator.completion(ids, s) for s in settings], every[1:], field)
        completions = [completion, *others]
        scope, loop = config.scope(bearer_key(request.headers.get("authorization", ""))), asyncio.get_running_loop()
        jobs = []
        for answer, rid in zip(completions, rids, strict=True):
            answer.scope = scope
            jobs.append(Job(answer, loop, request_id=rid))
        try:
            batcher.submit(*jobs)
        except QueueFullError as exc:
            raise api.APIError(
                429, f"the server is at capacity ({exc}): retry shortly", kind="rate_limit_error", code="queue_full"
            ) from None
        except ShuttingDownError as exc:
            raise api.APIError(503, f"{exc}: retry on another replica") from None
        except MemoryFullError as exc:
            if exc.alone:
                raise api.APIError(
                    400,
                    f"not enough memory for this request ({exc}): ask for fewer max_tokens or a shorter prompt",
                    param="max_tokens",
                    code="insufficient_memory",
                ) from None
            raise api.APIError(
                503,
                f"not enough memory for this request now ({exc}): retry shortly or ask for fewer max_tokens",
                code="insufficient_memory",
            ) from None
        return jobs

    return app


def openai_errors(app: FastAPI) -> None:
    """Every error ``app`` answers in OpenAI's shape: its own, request validation's, Starlette's (no such route, wrong
    method, an unreadable body) and any bug's (a 500 whose details go to the log, not the client)."""

    @app.exception_handler(api.APIError)
    async def api_error(request: Request, exc: api.APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return await api_error(request, _http_error(request, exc))

    @app.exception_handler(Exception)  # an app behind the gate never gets here: the gate answers its bugs itself
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
        return api.INTERNAL_ERROR.response()


DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request asks whether its client is still there
HEARTBEAT_S = 5.0  # a stream with no event for this long sends a comment, so proxies and clients see it is alive
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it
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


class Gate:
    """Every HTTP request passes here: Host and API keys are checked, requests counted by route and status in
    ``requests`` (on a server), answers tagged with ``replica`` (unless the app's answer names one already: the Ray
    ingress relays its replicas' answers).

    A plain ASGI middleware (Starlette's ``@app.middleware("http")`` wraps ``receive``): it reads the body itself,
    refusing it past ``max_request_bytes`` (413) or ``body_timeout_s`` (408) before anything parses it, then hands the
    app the body and the connection's own ``receive``, so a handler sees its client's disconnect directly.
    """

    def __init__(
        self, app: Callable, config: ServeConfig, requests: Counter | None = None, replica: str | None = None
    ) -> None:
        self.app, self.config, self.requests = app, config, requests
        self.tag = [] if replica is None else [(b"x-specdec-replica", replica.encode())]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def tagged(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.get("headers", [])
                named = any(key.lower() == b"x-specdec-replica" for key, _ in headers)
                message["headers"] = [*headers, *([] if named else self.tag)]
            await send(message)

        try:
            try:
                self._check(scope)
                body = await self._read_body(receive)
            except api.APIError as refusal:  # the body may be unread: the connection closes after the answer
                await refusal.response(close=True)(scope, receive, tagged)
            else:
                await self.app(scope, _replay(body, receive), tagged)
        # A bug: answered here (Starlette's own handler sits outside this gate, so its answer would be untagged).
        except Exception:
            log.exception("request %s %s failed", scope.get("method"), scope.get("path"))
            if status is None:
                await api.INTERNAL_ERROR.response()(scope, receive, tagged)
        finally:
            if self.requests is not None:
                route = scope.get("route")
                self.requests.labels(getattr(route, "path", "unmatched"), str(status or 500)).inc()

    def _check(self, scope: dict) -> None:
        headers = dict(scope["headers"])
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        hosts = self.config.answered_hosts
        if hosts and scope["path"] != "/health" and host not in hosts:
            raise api.APIError(
                403,
                "this server does not answer for the host name in the Host header (its operator can add it with "
                "--allowed-host)",
                code="host_not_allowed",
            )
        error = key_refusal(
            self.config.api_keys,
            self.config.open_metrics,
            scope["path"],
            headers.get(b"authorization", b"").decode("latin-1"),
        )
        if error is not None:
            raise error

    async def _read_body(self, receive: Callable) -> bytes:
        """The whole request body, refused past the size limit (also when no Content-Length announced it: chunked) or
        the time limit."""
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                while more:
                    message = await receive()
                    # The client left while sending: the app sees that at its next receive.
                    if message["type"] != "http.request":
                        break
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.config.max_request_bytes:
                        raise api.APIError(
                            413,
                            f"the request body is larger than this server's limit of {self.config.max_request_bytes} "
                            "bytes: shorten the prompt",
                            code="request_too_large",
                        )
                    more = message.get("more_body", False)
        except TimeoutError:
            raise api.APIError(
                408,
                f"the request body did not arrive within {self.config.body_timeout_s:g} s: send it at once",
                code="request_timeout",
            ) from None
        return b"".join(chunks)


def bearer_key(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header; None for another scheme or none."""
    scheme, _, given = authorization.partition(" ")
    return given.strip() or None if scheme.lower() == "bearer" else None


def key_refusal(keys: tuple[str, ...], open_metrics: bool, path: str, authorization: str) -> api.APIError | None:
    """OpenAI's 401 when ``path`` needs a key (keys set: /v1 routes, and /metrics and the docs unless open) and
    ``authorization`` has none that matches."""
    guarded = path.startswith("/v1/") or (path in DOCS and not open_metrics)
    if not keys or not guarded:
        return None
    given = bearer_key(authorization)
    if given and any(hmac.compare_digest(given.encode(), key.encode()) for key in keys):
        return None
    message = (
        "Incorrect API key provided."
        if authorization
        else (
            "You didn't provide an API key: send it in an Authorization header using Bearer auth "
            "(Authorization: Bearer YOUR_KEY)."
        )
    )
    return api.APIError(401, message, code="invalid_api_key" if authorization else None)


# A stream's choice as chunks: (text, its tokens, their log-probabilities or None, finish reason or None) -> the
# chunk, or None where the piece is held back for a later chunk
_ChunkOf = Callable[[str, list[int], list | None, str | None], dict | None]
_UsageOf = Callable[[int], dict]  # completion tokens -> the stream's usage chunk


@dataclass
class _Choice:
    """One choice of a stream: its job (None when it only echoes its prompt), the chunks that open it, and how the
    pieces of its answer become chunks."""

    job: Job | None
    opening: list[dict]
    chunk: _ChunkOf


async def _next_event(job: Job, batcher: Batcher, timeout: float) -> tuple[str, object] | None:
    """The job's next event, or None if none came within ``timeout``. An engine thread that failed ends its requests
    itself; should one have stopped without, its requests end with a 503 rather than wait forever."""
    if not job.events.empty():  # a stream's text events come in bursts: no timer for those
        return job.events.get_nowait()
    try:
        return await asyncio.wait_for(job.events.get(), timeout)
    except TimeoutError:
        if batcher.alive:
            return None
    try:  # the thread's last events are scheduled before it ends: give them a moment to arrive
        return await asyncio.wait_for(job.events.get(), 1.0)
    except TimeoutError:
        return "error", (503, f"the server's engine stopped before request {job.request_id} finished: retry")


def _sse(chunk: dict | None) -> str:
    """A chunk as an event; nothing for a piece held back."""
    return "" if chunk is None else api.sse(chunk)


async def _pump(index: int, job: Job, batcher: Batcher, into: asyncio.Queue) -> None:
    """Forward ``job``'s events to ``into``, each with choice ``index``, up to its last."""
    while True:
        event = await _next_event(job, batcher, HEARTBEAT_S)
        if event is not None:
            into.put_nowait((index, event))
            if event[0] != "text":
                return


def _stream(choices: list[_Choice], batcher: Batcher, usage: _UsageOf | None) -> StreamingResponse:
    """Server-sent events for ``choices``, their chunks interleaved as their steps come, each ending with its finish
    reason (and the tokens no piece carried); then the usage chunk where asked for, and [DONE]."""

    async def events() -> AsyncIterator[str]:
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [
            asyncio.create_task(_pump(i, choice.job, batcher, merged))
            for i, choice in enumerate(choices)
            if choice.job is not None
        ]
        try:
            for choice in choices:
                for opening in choice.opening:
                    yield api.sse(opening)
                if choice.job is None and (event := _sse(choice.chunk("", [], None, "length"))):
                    yield event
            sent, generated, running = [0] * len(choices), 0, len(pumps)
            while running:
                try:
                    index, (kind, payload) = await asyncio.wait_for(merged.get(), HEARTBEAT_S)
                except TimeoutError:  # still waiting (queued, or a long step): tell the client the stream is alive
                    yield KEEP_ALIVE
                    continue
                chunk = choices[index].chunk
                if kind == "text":
                    sent[index] += len(payload.tokens)
                    if event := _sse(chunk(payload.text, payload.tokens, payload.logprobs, None)):
                        yield event
                elif kind == "error":
                    yield api.stream_error(api.APIError(*payload))
                    return
                else:
                    rest = payload.token_ids[sent[index] :]
                    entries = None if payload.logprobs is None else payload.logprobs[sent[index] :]
                    if event := _sse(chunk("", rest, entries, api.FINISH[payload.finish_reason])):
                        yield event
                    generated += len(payload.token_ids)
                    running -= 1
            if usage is not None:
                yield api.sse(usage(generated))
            yield api.DONE
        except Exception:  # a bug after the 200 went out: the stream still ends in its protocol
            log.exception("a stream failed")
            yield api.stream_error(api.INTERNAL_ERROR)
        finally:
            for pump in pumps:
                pump.cancel()
            for choice in choices:
                if choice.job is not None:
                    choice.job.cancel()  # the client went away (or the stream ended): nothing more is wanted

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _result(job: Job, batcher: Batcher, request: Request) -> GenerationResult:
    """Wait for the job's end, cancelling it if the client disconnects meanwhile
    (checked every half second, events or not)."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_CHECK_S
    while True:
        try:
            event = await _next_event(job, batcher, max(check_at - loop.time(), 0.0))
        except asyncio.CancelledError:  # the server dropped the request (its client left): so does the engine
            job.cancel()
            raise
        kind, payload = event if event is not None else (None, None)
        if kind == "done":
            return payload
        if kind == "error":
            raise api.APIError(*payload)
        if loop.time() >= check_at:  # text events arrive every step: the check must not wait for a quiet moment
            if await request.is_disconnected():
                job.cancel()
                raise api.APIError(499, "the client closed the request")
            check_at = loop.time() + DISCONNECT_CHECK_S


def _validation_error(exc: RequestValidationError) -> api.APIError:
    """The first problem, named the way OpenAI names it."""
    error = exc.errors()[0]
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = api.clip(location[0]) if location else None  # the request field; the message shows the full path
    path = api.clip(".".join(location))
    if error.get("type") == "extra_forbidden":
        return api.APIError(400, f"Unrecognized request argument supplied: {path}", param=field)
    if error.get("type") == "json_invalid" or field is None:
        return api.APIError(400, "the request body is not a valid JSON object")
    if error.get("type") == "missing":
        return api.APIError(400, f"'{path}' is required", param=field)
    return api.APIError(
        400, f"'{path}': {error.get('msg', 'invalid value')} (got {api.excerpt(error.get('input'))})", param=field
    )


def _http_error(request: Request, exc: HTTPException) -> api.APIError:
    if exc.status_code == 404:
        return api.APIError(
            404, f"no route {request.method} {api.excerpt(request.url.path)}: the API is under /v1", code="unknown_url"
        )
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "another method")
        return api.APIError(
            405,
            f"{request.method} is not allowed on {api.excerpt(request.url.path)}: use {allowed}",
            code="method_not_allowed",
        )
    if exc.status_code == 400:  # FastAPI could not decode the body (not UTF-8, nested past Python's recursion limit)
        return api.APIError(400, "the request body is not valid JSON: send a UTF-8 JSON object")
    return api.APIError(exc.status_code, str(exc.detail)[: api.EXCERPT_CHARS])
