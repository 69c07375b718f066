"""Continuous batching: one thread owns the engine's decoder; requests join it between steps and leave when done.

HTTP handlers run on the event loop and never touch the model. They submit a
Job and read its events from an asyncio queue that this thread fills:
("text", Piece) as tokens are accepted, then ("done", GenerationResult) or
("error", (HTTP status, message)). Between two steps the thread admits waiting
jobs up to ``max_batch`` rows and drops cancelled ones (the decoder retires
finished ones itself), whose cache slots are freed at once. A request the
engine cannot take (its drafter refuses its settings) fails alone with a 400
(in a stream, whose 200 is already sent, an error event); a failing step fails
the jobs of that step and the loop goes on serving the others. Should anything
escape that handling, the thread ends every running and waiting job with a 500
before it stops, and calls ``on_death``: no request is left waiting. Clients
see a generic message naming their request id; the traceback goes to the log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.engine import Completion, Generator
from specdec.errors import SpecDecError
from specdec.memory import available_bytes
from specdec.serving.metrics import Metrics
from specdec.verification.logprobs import TokenLogprob

log = logging.getLogger("specdec.serve")


class QueueFullError(Exception):
    """Every batch slot is busy and the waiting queue is full: retry later."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no new requests."""


class MemoryFullError(Exception):
    """The KV caches of the requests already taken, and this one's, would not fit in the memory left; ``alone``: this
    request's would not fit even if every other request's cache were freed."""

    def __init__(self, message: str, alone: bool) -> None:
        super().__init__(message)
        self.alone = alone


MEMORY_SHARE = 0.9  # of the memory available now, what the KV caches of requests still to grow may claim


@dataclass(frozen=True)
class Piece:
    """What a step added to one request's answer: its text and the tokens since the last piece (with their
    log-probabilities where the request asks for them). Tokens whose text is held back (a partial character, a
    possible stop string) come with the piece that shows it, or with the result."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass(eq=False)
class Job:
    """One request as the engine thread sees it."""

    completion: Completion
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    sent_tokens: int = 0  # tokens handed out in pieces so far
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])  # what the client and the log both see

    def emit(self, kind: str, payload: object) -> None:
        """Hand an event to the request's handler (from the engine thread); a handler whose event loop is gone cancels
        the job."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody will read this request's events
            self.cancel()

    def cancel(self) -> None:
        """Ask the engine to drop this request (client gone); takes effect before the next step."""
        self.cancelled.set()


class Batcher:
    def __init__(self, generator: Generator, max_batch: int, max_queue: int, metrics: Metrics) -> None:
        self.generator = generator
        self.max_queue = max_queue
        self.metrics = metrics
        self.decoder = generator.batch_decoder(max_batch)
        # a runtime that holds one sequence per forward (llama.cpp) runs one request at a time
        self.max_batch = min(max_batch, self.decoder.backend.capabilities.max_rows or max_batch)
        # every request decodes with a fork: a drafter that cannot fork is refused now, not per request
        generator.drafter.fork()
        # what requests' k policies price steps by is measured now, before any request runs: not under this server's
        # own load, which would make every later step look dear
        generator.k_policy(generator.config, batched=True)
        self.waiting: deque[Job] = deque()
        self.active: dict[Completion, Job] = {}
        self._wake = threading.Condition()
        self._accepting = True
        self._stop = False
        self._failed = False  # the engine thread failed: nothing will answer a new request
        # called from the engine thread once it failed and ended its requests (the server then exits, to be restarted)
        self.on_death: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it ends only on stop(), or if a bug escapes its error handling)."""
        return self._thread.is_alive()

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (one request's answers) together: all are taken, or none (the error says why)."""
        with self._wake:
            if not self._accepting:
                raise ShuttingDownError("the server is shutting down")
            if self._failed or not self.alive:  # nothing would ever answer this request
                raise ShuttingDownError("the server's engine thread has stopped")
            # Free batch slots count as room: the engine thread admits waiting jobs only between steps, so a burst
            # arriving during one step queues up even while slots are free.
            if len(self.active) + len(self.waiting) + len(jobs) > self.max_batch + self.max_queue:
                raise QueueFullError(
                    f"{len(self.active)} requests are running and {len(self.waiting)} waiting "
                    f"(at most {self.max_batch} running and {self.max_queue} waiting)"
                )
            taken = len(self.waiting)
            try:
                for job in jobs:  # each checked beside those queued before it
                    self._check_memory(job)
                    self.waiting.append(job)
            except BaseException:  # none of the request's jobs stays queued without its reader
                while len(self.waiting) > taken:
                    self.waiting.pop()
                raise
            self.metrics.queue_depth.set(len(self.waiting))
            self._wake.notify()

    def _check_memory(self, job: Job) -> None:
        """Refuse ``job`` when every taken request grown to its full length (prompt and max_tokens), this one
        included, would need more KV cache than the memory available now where the caches live (the device's on
        CUDA; on the host, within the container's memory limit), as the runtime says its caches grow."""
        rows = self.decoder.backend

        def full(completion: Completion) -> int:
            return len(completion.prompt_ids) + completion.config.max_new_tokens

        own = rows.kv_bytes_for_rows([full(job.completion)])
        if not own:  # the runtime's cache does not grow with requests
            return
        held, free = rows.kv_bytes(), available_bytes(rows.device)
        if own > (free + held) * MEMORY_SHARE:
            raise MemoryFullError(f"its KV cache alone needs {own / 2**20:.0f} MiB", alone=True)
        taken = [j.completion for j in list(self.active.values()) + list(self.waiting)]
        needed = rows.kv_bytes_for_rows([full(c) for c in [job.completion, *taken]]) - held  # what they may grow by
        if needed > free * MEMORY_SHARE:
            raise MemoryFullError(
                f"the KV caches of the {len(taken) + 1} requests would need {needed / 2**20:.0f} MiB more and "
                f"{free * MEMORY_SHARE / 2**20:.0f} MiB is free",
                alone=False,
            )

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.active), len(self.waiting)

    def stop(self, timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout_s``, end the rest with a 503, end the
        thread.

        Safe to call again (from another thread too): it then returns once the first call's work is done.
        """
        with self._wake:
            self._accepting = False
        deadline = time.monotonic() + timeout_s
        while (self.active or self.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        """The engine thread: the loop, and, whatever escapes it, an end for every request still running or waiting."""
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - a failure inside the step's own failure handling, a bug
            with self._wake:
                self._failed = True
                jobs = [*self.active.values(), *self.waiting]
                self.active.clear()
                self.waiting.clear()
            log.critical(
                "the engine thread failed; ending its %d requests (%s)",
                len(jobs),
                ", ".join(job.request_id for job in jobs),
                exc_info=True,
            )
            for job in jobs:
                job.emit("error", internal_error(job))
            self.metrics.queue_depth.set(0)
            self.metrics.active.set(0)
            try:
                self.on_death()
            except Exception:  # noqa: BLE001 - the requests are answered; the log says what else went wrong
                log.exception("the engine thread's on_death failed")

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.active and not self.waiting:
                    self._wake.wait()
                if self._stop:
                    break
                self._admit()
            if not self.active:
                continue
            try:
                self._step()
            except Exception:  # noqa: BLE001 - one bad step must not take the server down
                log.exception(
                    "a decoding step failed (requests %s)", ", ".join(job.request_id for job in self.active.values())
                )
                for completion, job in list(self.active.items()):
                    self._finish(completion, error=internal_error(job))
        for job in list(self.waiting) + list(self.active.values()):
            job.emit("error", (503, "the server shut down before this request finished"))
        self.waiting.clear()  # a second stop() (the app's lifespan after the signal's) finds nothing left to wait for
        self.active.clear()

    def _step(self) -> None:
        """One decoding step of the batch: hand out the new text, answer the requests that ended, drop the cancelled
        ones."""
        updates = self.decoder.step()
        self.metrics.kv_bytes.set(self.decoder.backend.kv_bytes())
        for update in updates:
            job = self.active[update.completion]
            if job.first_token_s is None:
                job.first_token_s = time.perf_counter() - job.submitted
                self.metrics.ttft.observe(job.first_token_s)
            if update.text:
                job.emit("text", self._piece(job, update.text))
            if update.done:
                self._finish(update.completion, error=None)
        for completion, job in list(self.active.items()):
            if job.cancelled.is_set():
                self._finish(completion, error=None, cancelled=True)

    @staticmethod
    def _piece(job: Job, text: str) -> Piece:
        """``text`` with the tokens the job's completion gained since its last piece."""
        completion, start = job.completion, job.sent_tokens
        job.sent_tokens = len(completion.token_ids)
        logprobs = None if completion.logprobs is None else completion.logprobs[start:]
        return Piece(text, completion.token_ids[start:], logprobs)

    def _admit(self) -> None:
        """Move waiting jobs into the batch while there is room (called with the lock held)."""
        while self.waiting and len(self.active) < self.max_batch:
            job = self.waiting.popleft()
            if job.cancelled.is_set():
                continue
            try:
                self.generator.admit(self.decoder, job.completion)
            except SpecDecError as exc:
                # the request asks what this engine cannot do (e.g. sampling with a greedy-only drafter)
                job.emit("error", (400, str(exc)))
                continue
            except Exception:  # noqa: BLE001 - a request the engine cannot take fails alone
                log.exception("could not start decoding request %s", job.request_id)
                job.emit("error", internal_error(job))
                continue
            self.active[job.completion] = job
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.active.set(len(self.active))

    def _finish(self, completion: Completion, error: tuple[int, str] | None, cancelled: bool = False) -> None:
        """Take ``completion`` out of the batch (if the decoder has not retired it) and tell its handler how it ended
        (``error``: HTTP status and message)."""
        job = self.active[completion]
        if error is None:  # counted before the request stops showing as running, so /health and /metrics agree
            self.metrics.record(completion, time.perf_counter() - job.submitted, cancelled)
        self.decoder.leave(completion)
        del self.active[completion]
        self.metrics.kv_bytes.set(self.decoder.backend.kv_bytes())
        self.metrics.active.set(len(self.active))
        if error is not None:
            job.emit("error", error)
        elif not cancelled:
            job.emit("done", completion.result())


def internal_error(job: Job) -> tuple[int, str]:
    """What a client is told when the engine fails on its request: a 500 naming the request, the details in the log."""
    return 500, f"internal error while decoding request {job.request_id} (the server's log has the details)"
