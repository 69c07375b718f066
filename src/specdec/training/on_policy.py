"""On-policy distillation data: prompts from the corpus or general topics, continued by the target itself, in batches.

A draft is judged on the target's own outputs, not on corpus text, so it should
learn from them: the chat answers, summaries and code continuations the target
writes. Prompts come in the three shapes users send (a plain text to continue, a
``User: ... / Assistant:`` request, the model's own chat template), built from
random passages of the corpus so that any corpus yields them, for any target.
A technical corpus only asks technical things, so general prompts (everyday
questions and story or essay openings on a shipped list of topics, in English
and Chinese) can be mixed in: the target's answers to them are what a chat or
writing request gets, and what a draft must learn to predict there.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import torch

from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.models.target import eos_ids
from specdec.training.ngram import corpus_files, documents

# Requests about a passage; the passage follows on its own lines.
PASSAGE_REQUESTS = (
    "Summarize this in two sentences.",
    "Explain what this means in simple terms.",
    "What is the main point of this text?",
    "List the key facts in this text.",
    "Rewrite this more clearly.",
    "Explain what this code does.",
    "Continue this text.",
    "Write three questions a reader might ask about this, and answer them.",
)
# Questions about a topic named in the corpus (a heading, a function or class name).
TOPIC_QUESTIONS = (
    "Can you explain {} in simple terms?",
    "What is {} and when would I use it?",
    "Give me a short example of {}.",
    "What are common mistakes with {}?",
)
_HEADING = re.compile(r"^(?:#{1,4}\s+(.{4,60})|(?:def|class)\s+([A-Za-z_]\w{3,40}))", re.MULTILINE)


def corpus_prompts(sources: list[str], seed: int, chat_template: Callable[[str], str] | None) -> Iterator[str]:
    """An endless, seeded stream of prompts built from random passages of the corpus files."""
    files = [f for f in corpus_files(sources) if f.suffix != ".jsonl"]
    if not files:
        raise ConfigError("on-policy data needs text files or folders among --data to draw prompts from")
    rng = random.Random(seed)
    for index in range(10**12):
        text = _random_document(rng, files)
        if not text:
            continue
        passage = _passage(rng, text, rng.randint(200, 700))
        shape = index % 4
        if shape == 0:
            yield passage
        elif shape == 1:
            yield f"User: {rng.choice(PASSAGE_REQUESTS)}\n\n{passage}\nAssistant:"
        elif shape == 2 and chat_template is not None:
            yield chat_template(f"{rng.choice(PASSAGE_REQUESTS)}\n\n{passage}")
        elif topics := [a or b for a, b in _HEADING.findall(text)]:
            yield f"User: {rng.choice(TOPIC_QUESTIONS).format(rng.choice(topics).strip())}\nAssistant:"
        else:
            yield passage


def general_prompts(seed: int) -> Iterator[str]:
    """An endless, seeded stream of general chat requests and writing openings
    (``data/training/general_prompts.json``)."""
    table = json.loads(
        resources.files("specdec").joinpath("data/training/general_prompts.json").read_text(encoding="utf-8")
    )
    languages = [table[language] for language in ("en", "zh")]
    rng = random.Random(seed)
    while True:
        # Every topic equally likely.
        language = rng.choices(languages, weights=[len(lang["topics"]) for lang in languages])[0]
        templates = language["requests"] if rng.random() < 0.5 else language["openings"]
        template, topic = rng.choice(templates), rng.choice(language["topics"])
        yield template.format(topic=topic[0].upper() + topic[1:] if template.startswith("{topic}") else topic)


def mixed_prompts(corpus: Iterator[str], general: Iterator[str], general_share: float, seed: int) -> Iterator[str]:
    """Prompts from ``general`` with probability ``general_share``, else from ``corpus``."""
    rng = random.Random(seed + 1)
    while True:
        yield next(general if rng.random() < general_share else corpus)


def _random_document(rng: random.Random, files: list[Path]) -> str:
    docs = _documents_of(rng.choice(files))
    return rng.choice(docs) if docs else ""


@functools.lru_cache(maxsize=64)
def _documents_of(path: Path) -> tuple[str, ...]:
    """A file's pieces of text, read once (prompts come back to the same files)."""
    return tuple(text for text, _ in documents(path))


def _passage(rng: random.Random, text: str, length: int) -> str:
    """About ``length`` characters of ``text`` starting and ending on line boundaries."""
    if len(text) <= length:
        return text.strip()
    start = text.rfind("\n", 0, rng.randrange(len(text) - length)) + 1
    end = text.find("\n", start + length)
    return text[start : end if end > 0 else len(text)].strip()


def prompt_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as the model reads a prompt: with its beginning-of-sequence token, written once (a chat
    template's text already starts with it)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def chat_template_of(target: LoadedModel) -> Callable[[str], str] | None:
    """The target's own chat format for one user message, when its tokenizer has one."""
    tokenizer = target.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    return lambda message: tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


@torch.inference_mode()
def continue_prompts(
    target: LoadedModel, prompts: Iterator[str], max_new_tokens: int, batch: int
) -> Iterator[tuple[list[int], int]]:
    """(prompt ids + the target's greedy continuation up to its end-of-sequence token, continuation length), ``batch``
    prompts at a time."""
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise ConfigError(f"target '{target.name}' has no tokenizer to write prompts with")
    stops = sorted(eos_ids(target)) or [-1]  # the tokens that end the target's turn, as in the engine
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else max(stops[0], 0)
    while group := [p for _, p in zip(range(batch), prompts, strict=False)]:
        encoded = [prompt_ids(tokenizer, p)[-512:] for p in group]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = target.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=stops,
            )
        for prompt, row in zip(encoded, out[:, width:].tolist(), strict=True):
            ends = [i for i, t in enumerate(row) if t in stops]
            written = row[: ends[0] + 1] if ends else row
            yield prompt + written, len(written)
