"""The OpenAI-compatible server: HTTP routes (app), continuous batching (batcher), metrics, and running it (server)."""

from __future__ import annotations

from specdec.serving.server import serve

__all__ = ["serve"]
