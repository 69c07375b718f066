"""The OpenAI-compatible server: HTTP routes (app), continuous batching (batcher), metrics."""

from __future__ import annotations

from specdec.config import ServeConfig
from specdec.engine import Generator


def serve(generator: Generator, config: ServeConfig = ServeConfig()) -> None:
    """Run the server until interrupted; on SIGINT/SIGTERM in-flight requests get ``config.drain_s`` to finish."""
    import uvicorn

    from specdec.serving.app import create_app

    app = create_app(generator, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=int(config.drain_s) or None)


__all__ = ["serve"]
