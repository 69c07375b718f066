"""The server's suffix history: one store of earlier answers for all its requests, loaded from a file at start and
saved to it as the server runs (every so often, and at stop)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from specdec.drafters import Drafter, SuffixDrafter, SuffixStore
from specdec.drafters.suffix import DamagedCacheError
from specdec.engine.costs import MachineCosts
from specdec.engine.generator import concrete_draft
from specdec.errors import ConfigError
from specdec.models import Target
from specdec.serving.config import ServeConfig

log = logging.getLogger("specdec.serve")


def server_drafter(draft: str, target: Target, config: ServeConfig) -> tuple[str | Drafter, SuffixStore | None]:
    """The drafter a server builds for ``draft`` (``auto`` made concrete from this machine's costs), and its suffix
    store when it keeps one (suffix drafting): sized by ``config`` and loaded from its ``suffix_cache`` file when that
    exists. A file of another model, or too large, is a ConfigError (one line); a damaged one (a crash while it was
    written by an older specdec, a bad disk) is moved aside with a warning, and the history starts empty."""
    draft = str(concrete_draft(draft, target, MachineCosts(target.backend)))
    if draft != "suffix":
        return draft, None
    path = config.suffix_cache
    if path is not None and not Path(path).parent.is_dir():
        raise ConfigError(f"--suffix-cache {path}: its folder does not exist; create it or pass another path")
    if path is not None and Path(path).exists() and not Path(path).is_file():
        raise ConfigError(f"--suffix-cache {path} is not a file: pass the path of a file (it need not exist yet)")
    store = SuffixStore(config.suffix_max_tokens)
    if path is not None and Path(path).exists():
        try:
            store = SuffixStore.load(path, target.name, target.backend.vocab_size, config.suffix_max_tokens)
        except DamagedCacheError as exc:
            try:
                aside = move_aside(Path(path))
            except OSError as move:
                raise ConfigError(
                    f"{exc}; moving it aside failed ({move}): remove it, or pass another --suffix-cache"
                ) from None
            log.warning("%s; moved it to %s, and the suffix history starts empty", exc, aside)
    return SuffixDrafter(store), store


def move_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.damaged-<time>`` (never over an earlier one) and return the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.damaged-{stamp}-{n}"), n + 1
    os.replace(path, aside)
    return aside


class HistoryKeeper:
    """Keeps a server's suffix history in its file: saved every ``every_s`` seconds when it changed (0: only at stop)
    and at stop. A save runs in a thread: the store copies its state under its lock and writes the copy, so requests
    and the engine go on meanwhile; a kill at any moment leaves the last whole save."""

    def __init__(self, history: SuffixStore, path: str, model: str, every_s: float) -> None:
        self.history, self.path, self.model, self.every_s = history, path, model, every_s
        self._saved = history.changes  # what the file holds already (loaded from it, or nothing)
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the periodic saves (in the running event loop)."""
        if self.every_s > 0:
            self._task = asyncio.create_task(self._periodically())

    async def stop(self) -> None:
        """Let a save under way finish, stop the periodic ones, and save what changed since."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        await self.save(at_stop=True)

    async def _periodically(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self.every_s)
                return
            except TimeoutError:
                await self.save()

    async def save(self, at_stop: bool = False) -> None:
        """Write the history if it changed since the last save; a failure is logged (the server goes on)."""
        changes = self.history.changes
        if changes == self._saved:
            return
        try:
            await asyncio.to_thread(self.history.save, self.path, self.model)
        except OSError as exc:
            log.error("could not save the suffix history to %s: %s", self.path, exc)
            return
        except Exception:  # noqa: BLE001 - a bug must not end the periodic saves nor skip the one at stop
            log.exception("could not save the suffix history to %s", self.path)
            return
        self._saved = changes
        log.log(
            logging.INFO if at_stop else logging.DEBUG,
            "saved %d tokens of suffix history to %s",
            self.history.token_count,
            self.path,
        )
