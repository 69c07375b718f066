"""Training data written by the target itself: its continuations of prompts, greedy and sampled, with the final
hidden states a feature-reading head (the eagle head) reads at every position, decoded in batches.

The target decodes dozens of rows together (``Generator.generate_batch``; the native runtime is the fastest here), so
data costs what batched decoding costs. A :class:`FeatureRecorder` rides along as the drafter: it proposes nothing and
keeps the hidden states the engine hands a feature-reading drafter after every step, which are the ones a head reads
when it drafts. Prompts come from a seeded stream: general requests and writing openings, and passages of text and
code (the Python standard library by default) in the shapes users send. A share of the rows samples at a temperature
drawn from a range, so a head can learn the sampled distribution, not only the argmax.

A run writes one shard per batch (``shard-NNNNN.safetensors``, written whole or not at all) and lists it in
``manifest.json`` with the run's settings; run again with the same settings, it continues after the last shard (the
prompts, temperatures and seeds of a batch depend only on its number, so a resumed run writes what an unbroken one
would have). Each shard holds, per sequence: its row, its token ids (prompt, then output), the prompt's length, the
temperature (0: greedy) and the hidden state after every position but the last (``[tokens - 1, hidden]``, bfloat16).
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from specdec.atomic import atomic_write_bytes
from specdec.config import BatchConfig, GenerationConfig, SamplingConfig
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.engine import Generator
from specdec.errors import ConfigError
from specdec.models.target import Target
from specdec.training.on_policy import chat_template_of, corpus_prompts, general_prompts, mixed_prompts, prompt_ids

MANIFEST = "manifest.json"
LAYOUT = 1  # the shards' layout, in the manifest: change it with what a shard holds
Progress = Callable[[str, float, float, dict], None]  # phase, done, total, figures


def standard_library() -> str:
    """The Python standard library's folder: text and code any machine with Python has, without a hub."""
    return sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class DataConfig:
    """What a data run writes; every field but ``out`` and ``tokens`` must match to continue a run."""

    out: str
    tokens: int = 200_000  # new tokens the target writes in all (the run stops after the batch that reaches it)
    sources: tuple[str, ...] = field(default_factory=lambda: (standard_library(),))  # passages for prompts
    batch: int = 32  # rows decoded together: one shard
    max_new_tokens: int = 128
    max_prompt_tokens: int = 384  # a longer prompt keeps its last tokens
    sampled_share: float = 0.5  # rows that sample; the rest are greedy
    temperatures: tuple[float, float] = (0.7, 1.0)  # a sampling row's temperature, drawn uniformly in this range
    general_share: float = 0.3  # prompts from general topics; the rest from passages of ``sources``
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.batch < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 2:
            raise ConfigError(
                "--tokens, --batch and --max-new-tokens must be at least 1, --max-prompt-tokens at least 2"
            )
        for name, share in (("--sampled-share", self.sampled_share), ("--general-share", self.general_share)):
            if not 0 <= share <= 1:
                raise ConfigError(f"{name} is a share between 0 and 1, not {share}")
        low, high = self.temperatures
        if not 0 < low <= high:
            raise ConfigError(f"the temperature range must be positive and ordered (low, high), not {low}, {high}")

    def settings(self) -> dict:
        """The fields a continued run must share with the one it continues."""
        fields = asdict(self)
        for name in ("out", "tokens"):
            fields.pop(name)
        fields["sources"] = list(self.sources)
        fields["temperatures"] = list(self.temperatures)
        return fields


@dataclass(frozen=True)
class Written:
    """One sequence the target wrote: its tokens (prompt, then output), and the hidden state after each but the last."""

    tokens: torch.Tensor  # [T] long
    prompt_length: int
    temperature: float  # 0: greedy
    features: torch.Tensor  # [T - 1, H] bfloat16
    # its row in the run (its settings: ``row_config(config, row)``); while a batch decodes, its slot in the batch
    row: int = 0


class FeatureRecorder(Drafter):
    """A drafter that proposes nothing and keeps the target's final hidden states of every position its sequence fed.

    ``sink`` (shared by the forks) has a slot per fork, in the order they are made (``generate_batch`` forks one per
    row as its rows join, in prompt order: ``write_data`` checks each slot against its row's prompt and output); when a
    fork's sequence ends, its :class:`Written` (``row``: the slot) fills the slot."""

    capabilities = DrafterCapabilities(features=True)

    def __init__(self, sink: list[Written | None], slot: int = -1) -> None:
        self.sink = sink
        self.slot = slot
        self._features: list[torch.Tensor] = []
        self._temperature = 0.0

    def begin(self, settings: DraftSettings) -> None:
        self._features = []
        self._temperature = 0.0 if settings.sampling.greedy else settings.sampling.temperature

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        return Proposal.empty()

    def observe_features(self, features: torch.Tensor) -> None:
        self._features.append(features.detach().to("cpu", torch.bfloat16))

    def finish(self, tokens: torch.Tensor, prompt_length: int) -> None:
        features, self._features = self._features, []
        fed = sum(len(f) for f in features)
        if fed and fed == len(tokens) - 1 and self.slot >= 0:  # one that left within a step has no whole record
            self.sink[self.slot] = Written(
                tokens.detach().cpu().clone(), prompt_length, self._temperature, torch.cat(features), self.slot
            )

    def fork(self) -> FeatureRecorder:
        self.sink.append(None)
        return FeatureRecorder(self.sink, len(self.sink) - 1)


def prompt_stream(target: Target, config: DataConfig) -> Iterator[str]:
    """The run's seeded, endless stream of prompts."""
    general = general_prompts(config.seed)
    if config.general_share >= 1:
        return general
    corpus = corpus_prompts(list(config.sources), config.seed, chat_template_of(target))
    return mixed_prompts(corpus, general, config.general_share, config.seed)


def row_config(config: DataConfig, row: int) -> GenerationConfig:
    """Row ``row``'s settings: greedy, or sampling at a temperature from the range with its own seed; a function of the
    run's seed and the row's number alone."""
    rng = random.Random(f"{config.seed}/{row}")
    sampling = SamplingConfig(temperature=0.0)
    if rng.random() < config.sampled_share:
        sampling = SamplingConfig(temperature=round(rng.uniform(*config.temperatures), 3))
    return GenerationConfig(
        max_new_tokens=config.max_new_tokens, sampling=sampling, seed=config.seed * 1_000_003 + row, k_policy="fixed"
    )


def write_data(target: Target, config: DataConfig, progress: Progress = lambda *a: None) -> dict:
    """Write (or continue) the run in ``config.out`` until ``config.tokens`` new tokens are written; returns the
    manifest."""
    if not (target.backend.capabilities.features and target.backend.capabilities.max_rows != 1):
        raise ConfigError(
            f"writing training data needs a runtime that batches and returns hidden states; '{target.runtime}' does "
            "not: use --runtime native (fastest on a CPU) or transformers"
        )
    if target.tokenizer is None:
        raise ConfigError(f"target '{target.name}' has no tokenizer to write prompts with")
    if config.max_prompt_tokens + config.max_new_tokens > target.backend.max_context:
        raise ConfigError(
            f"--max-prompt-tokens {config.max_prompt_tokens} and --max-new-tokens {config.max_new_tokens} exceed the "
            f"context of {target.backend.max_context} tokens: lower them"
        )
    out = Path(config.out)
    manifest = read_manifest(out)
    header = {"layout": LAYOUT, "target": target.name, "model": target.backend.info.name, "settings": config.settings()}
    if manifest is None:
        manifest = {**header, "shards": []}
    elif {k: manifest.get(k) for k in header} != header:
        given, held = {**header, **header["settings"]}, {**manifest, **(manifest.get("settings") or {})}
        differs = [f"{k} {held.get(k)!r}" for k in sorted(given) if k != "settings" and held.get(k) != given[k]]
        raise ConfigError(
            f"'{out}' holds data written with other settings ({', '.join(differs)}): continue it with those (the "
            "same target, runtime, format and kernel build), or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    sink: list[Written | None] = []
    generator = Generator(
        target, FeatureRecorder(sink), GenerationConfig(k_policy="fixed"), batch=BatchConfig(k_cap="fixed")
    )
    prompts = encoded_prompts(target, config)
    for _ in range(len(manifest["shards"]) * config.batch):  # the prompts of the shards already written
        next(prompts)
    written = sum(s["new_tokens"] for s in manifest["shards"])
    seconds = sum(s["seconds"] for s in manifest["shards"])
    progress("target writing data", written, config.tokens, {})
    while written < config.tokens:
        index = len(manifest["shards"])
        rows = range(index * config.batch, (index + 1) * config.batch)
        batch = [next(prompts) for _ in rows]
        configs = [row_config(config, row) for row in rows]
        sink.clear()
        started = time.perf_counter()
        results = generator.generate_batch(batch, configs)
        took = time.perf_counter() - started
        kept = [w for w in sink if w is not None]
        for w in kept:
            prompt, output = w.tokens[: w.prompt_length].tolist(), w.tokens[w.prompt_length :].tolist()
            if prompt != batch[w.row] or output != results[w.row].token_ids:
                raise RuntimeError(f"recorded sequence {w.row} is not its row's: the batch forked rows out of order")
        shard = _shard([replace(w, row=rows.start + w.row) for w in kept])
        name = f"shard-{index:05d}.safetensors"
        atomic_write_bytes(out / name, save_safetensors(shard))
        new = int((shard["lengths"] - shard["prompt_lengths"]).sum())
        entry = {"file": name, "sequences": len(shard["lengths"]), "tokens": len(shard["tokens"]), "new_tokens": new}
        manifest["shards"].append(entry | {"seconds": took})
        atomic_write_bytes(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        written += new
        seconds += took
        progress("target writing data", written, config.tokens, {"new_tokens_per_s": written / max(seconds, 1e-9)})
    return manifest


def encoded_prompts(target: Target, config: DataConfig) -> Iterator[list[int]]:
    """The run's prompts as token ids, each cut to its last ``max_prompt_tokens`` (its beginning-of-sequence token
    kept); an empty one is passed over (the same ones on every run)."""
    tokenizer = target.tokenizer
    bos = getattr(tokenizer, "bos_token_id", None)
    for text in prompt_stream(target, config):
        ids = prompt_ids(tokenizer, text)
        if len(ids) > (1 if bos is not None and ids[:1] == [bos] else 0):
            yield _cut(ids, config.max_prompt_tokens, bos)


def _cut(ids: list[int], longest: int, bos: int | None) -> list[int]:
    """A prompt's last ``longest`` tokens, its beginning-of-sequence token kept in front."""
    if len(ids) <= longest:
        return ids
    if bos is not None and ids[0] == bos:
        return [bos] + ids[len(ids) - longest + 1 :]
    return ids[len(ids) - longest :]


def _shard(sequences: list[Written]) -> dict[str, torch.Tensor]:
    if not sequences:
        raise RuntimeError("a batch ended with no sequence whole: nothing to write (the engine lost its rows)")
    return {
        "rows": torch.tensor([w.row for w in sequences], dtype=torch.int64),
        "tokens": torch.cat([w.tokens for w in sequences]).to(torch.int32),
        "lengths": torch.tensor([len(w.tokens) for w in sequences], dtype=torch.int64),
        "prompt_lengths": torch.tensor([w.prompt_length for w in sequences], dtype=torch.int64),
        "temperatures": torch.tensor([w.temperature for w in sequences], dtype=torch.float32),
        "features": torch.cat([w.features for w in sequences]),
    }


def read_manifest(out: Path) -> dict | None:
    """A run's manifest, None where there is none; a damaged or foreign one is a ConfigError naming the file."""
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"'{path}' is damaged ({exc}): remove the folder to start over") from None
    if not isinstance(manifest, dict) or manifest.get("layout") != LAYOUT or "shards" not in manifest:
        raise ConfigError(f"'{path}' is not a manifest of this specdec's training data: choose another --out")
    return manifest


def read_sequences(out: str | Path) -> Iterator[Written]:
    """Every sequence of a run, shard by shard."""
    folder = Path(out)
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(
            f"'{folder}' holds no training data ({MANIFEST} is missing): write it with specdec distill-data"
        )
    for entry in manifest["shards"]:
        try:
            shard = load_safetensors((folder / entry["file"]).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"shard '{folder / entry['file']}' is missing or damaged ({exc})") from None
        start, fed = 0, 0
        columns = ("lengths", "prompt_lengths", "temperatures", "rows")
        for length, prompt, temperature, row in zip(*(shard[c].tolist() for c in columns), strict=True):
            tokens = shard["tokens"][start : start + length].long()
            yield Written(tokens, prompt, temperature, shard["features"][fed : fed + length - 1], row)
            start, fed = start + length, fed + length - 1
