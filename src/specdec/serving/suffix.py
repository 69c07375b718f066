"""The server's suffix history: one store of earlier answers for all its requests, loaded from and saved to a file."""

from __future__ import annotations

from pathlib import Path

from specdec.drafters import Drafter, SuffixDrafter, SuffixStore
from specdec.engine.costs import MachineCosts
from specdec.engine.generator import concrete_draft
from specdec.errors import ConfigError
from specdec.models import Target
from specdec.serving.config import ServeConfig


def server_drafter(draft: str, target: Target, config: ServeConfig) -> tuple[str | Drafter, SuffixStore | None]:
    """The drafter a server builds for ``draft`` (``auto`` made concrete from this machine's costs), and its suffix
    store when it keeps one (suffix drafting): sized by ``config`` and loaded from its ``suffix_cache`` file when that
    exists (a bad file: ConfigError, one line)."""
    draft = str(concrete_draft(draft, target, MachineCosts(target.backend)))
    if draft != "suffix":
        return draft, None
    path = config.suffix_cache
    if path is not None and not Path(path).parent.is_dir():
        raise ConfigError(f"--suffix-cache {path}: its folder does not exist; create it or pass another path")
    if path is not None and Path(path).exists():
        store = SuffixStore.load(path, target.name, target.backend.vocab_size, config.suffix_max_tokens)
    else:
        store = SuffixStore(config.suffix_max_tokens)
    return SuffixDrafter(store), store
