"""Prompt sets: JSONL files, one {"id", "category", "prompt"} object per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ConfigError

DEFAULT_PROMPTS = "benchmarks/prompts/default.jsonl"  # the project's 44 prompts in four categories


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read and validate a prompt file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file '{path}' does not exist: pass a JSONL file of {{id, category, prompt}} objects")
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
