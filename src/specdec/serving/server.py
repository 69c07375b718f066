"""Running the app on uvicorn: connection time-outs, and a shutdown that ends every request in its protocol.

On SIGTERM or SIGINT the server stops accepting connections and the batcher
stops admitting requests; requests in flight get ``shutdown_timeout_s`` to
finish, then each remaining one is ended by the engine (a stream with an
error event and ``[DONE]``, a whole response with a 503), and the process
exits with code 0. A second SIGINT forces the exit.

If the engine thread fails (it ends its requests with a 500 first), the server
shuts down the same way and the process exits with code 1, so that a supervisor
restarts it: a fresh process, not an engine whose state a failure left unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.drafters import SuffixStore
from specdec.engine import Generator
from specdec.serving.config import ServeConfig

# After --shutdown-timeout the engine ends the last requests between two steps (a step can take seconds on a CPU, and
# Batcher.stop waits up to 10 s for its thread); their handlers then send the final events.
# uvicorn waits this much longer.
SHUTDOWN_MARGIN_S = 15.0


def serve(generator: Generator, config: ServeConfig = ServeConfig(), history: SuffixStore | None = None) -> None:
    """Run the server until SIGTERM or SIGINT, then shut down gracefully (see the module's docstring); ``history``:
    the suffix drafter's store (create_app)."""
    from specdec.serving.app import create_app

    _log_to_stderr()
    app = create_app(generator, config, history)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info",
            http=_protocol(config.header_timeout_s),
            timeout_keep_alive=config.keep_alive_s,
            timeout_graceful_shutdown=config.shutdown_timeout_s + SHUTDOWN_MARGIN_S,
        ),
        on_exit=lambda: app.state.batcher.stop(config.shutdown_timeout_s),
    )
    died = threading.Event()

    def engine_died() -> None:
        died.set()
        server.handle_exit(signal.SIGTERM, None)

    app.state.batcher.on_death = engine_died
    server.run()
    if died.is_set():
        logging.getLogger("specdec.serve").critical("the engine thread failed: exiting with code 1 to be restarted")
        raise SystemExit(1)


class _Server(uvicorn.Server):
    """uvicorn's server, but a signal also starts the engine's drain at once (not after uvicorn gave up waiting for
    connections, by when it has cut the streams off) and is not raised again after shutdown (exit code 0)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._draining = False

    def handle_exit(self, sig: int, frame: object) -> None:
        super().handle_exit(sig, frame)
        if not self._draining:
            self._draining = True
            threading.Thread(target=self._on_exit, name="specdec-drain", daemon=True).start()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _protocol(header_timeout_s: float) -> type[H11Protocol]:
    class HeaderDeadline(H11Protocol):
        """h11 with a deadline on each request's headers, counted from the connection's start or the request's first
        byte: a client that opens connections and sends nothing, or dribbles its headers (slowloris), is cut off."""

        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # this request's headers are not complete yet
                if self._timer is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def _log_to_stderr() -> None:
    """The engine's own log lines (which replica this is, failed steps) next to uvicorn's."""
    logger = logging.getLogger("specdec")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
