"""Prompt sets: JSONL files, one {"id", "category", "prompt"} object per line.

The project's sets ship inside the package (``specdec/data/prompts``) and are addressed by name
(``default``, ``core``, ``mixed``, ``long``), so every benchmark's default works from a wheel and from any
folder; any other JSONL file is passed by its path.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ConfigError

SETS_FOLDER = Path(__file__).resolve().parent.parent / "data" / "prompts"  # prompt sets shipped in the package
DEFAULT_PROMPTS = "default"  # the project's 44 prompts in four categories


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str


def prompt_sets() -> dict[str, Path]:
    """The prompt sets shipped in the package, by name."""
    return {path.stem: path for path in sorted(SETS_FOLDER.glob("*.jsonl"))}


def resolve_prompts(spec: str | Path) -> Path:
    """A shipped set's file for its name, else ``spec`` as a path (a file named like a set: pass it as ./NAME)."""
    sets = prompt_sets()
    if isinstance(spec, str) and spec in sets:
        return sets[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"prompts '{spec}' does not exist: it is neither a prompt set ({', '.join(sets)}; `specdec prompts` lists "
            "them) nor a file. Pass a set's name or a JSONL file of {id, category, prompt} objects"
        )
    return path


def load_prompts(spec: str | Path) -> list[BenchPrompt]:
    """Read and validate a prompt set (by name) or file; errors name the file and line."""
    path = resolve_prompts(spec)
    prompts: list[BenchPrompt] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} is not valid JSON ({exc.msg}): each line must be one object") from None
        if not isinstance(item, dict):
            raise ConfigError(f'{where} is not a JSON object: each line must be {{"id", "category", "prompt"}}')
        missing = [key for key in ("id", "category", "prompt") if not isinstance(item.get(key), str) or not item[key]]
        if missing:
            raise ConfigError(f"{where} lacks a non-empty string for {', '.join(missing)}")
        if item["id"] in seen:
            raise ConfigError(f"{where} repeats the id '{item['id']}': ids must be unique")
        seen.add(item["id"])
        prompts.append(BenchPrompt(item["id"], item["category"], item["prompt"]))
    if not prompts:
        raise ConfigError(f"prompts file '{path}' has no prompts")
    return prompts


def round_robin(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Prompts taken in turn from each category, so that any prefix of the list mixes the kinds of text."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    columns = itertools.zip_longest(*by_category.values())
    return [p for column in columns for p in column if p is not None]
