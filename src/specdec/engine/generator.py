"""The library entry point: a target, a drafter and a config; prompts in, text and stats out."""

from __future__ import annotations

import json
import random
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Literal

from specdec.config import BatchConfig, GenerationConfig, RuntimeConfig, with_overrides
from specdec.drafters import Drafter, auto_draft, build_drafter
from specdec.engine.costs import machine_batch_cost_curve, machine_cost_curve, machine_draft_step, machine_tree_overhead
from specdec.engine.decoder import Decoder
from specdec.engine.stats import DecodeStats
from specdec.engine.text import TextTracker
from specdec.errors import ConfigError, ContextLengthError, PromptError, VocabularyMismatchError
from specdec.guards import Guards, NoGuards, ignorable_tokens
from specdec.models import DEFAULT_TARGET, Backend, LoadedModel, Target, TransformersBackend, open_target
from specdec.models.backend import TREES_UNSUPPORTED, OneRow, RowBackend
from specdec.models.batched import BatchedTransformersBackend
from specdec.profile import Profile, ProfileWarning, load_profile
from specdec.quality import SentenceEmbedder
from specdec.scheduling import CostCurve, KPolicy, LoadWindow, WayRates, build_k_policy, memory_in_use
from specdec.seeds import Seeds

FinishReason = Literal["length", "eos", "stop", "context"]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the new tokens only
    stats: DecodeStats
    finish_reason: FinishReason

    def to_dict(self) -> dict[str, object]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }


class Generator:
    """Speculative text generation whose output is the target's own.

    ``target`` and ``drafter`` are names (``"gemma-3-270m"``, ``"prompt-lookup"``,
    ``"model:PATH"``) or ready objects; ``runtime`` says where named models run
    (transformers or llama.cpp, dtype, threads); ``config`` holds the defaults
    that keyword arguments of :meth:`generate` and :meth:`stream` override;
    ``batch`` sets how :meth:`generate_batch` sizes its speculation window.
    """

    def __init__(
        self,
        target: str | LoadedModel | Target = DEFAULT_TARGET,
        drafter: str | Drafter = "none",
        config: GenerationConfig | None = None,
        runtime: RuntimeConfig = RuntimeConfig(),
        batch: BatchConfig = BatchConfig(),
    ) -> None:
        self.config = config or GenerationConfig()
        self.batch = batch
        self.target = target if isinstance(target, Target) else open_target(target, runtime)
        self.tokenizer = self.target.tokenizer
        self.backend = self.target.backend
        self._costs: CostCurve | None = None
        self._tree_overhead: CostCurve | None = None
        self._ways: dict[
            tuple[int, int, bool, bool], WayRates
        ] = {}  # timed tree rows': by k, branches, greedy, batched
        self._measuring = threading.Lock()
        if drafter == "auto":
            drafter = auto_draft(self.target, self.costs)
        self.draft_name = (
            drafter if isinstance(drafter, str) else type(drafter).__name__
        )  # what drafts (``auto`` resolved)
        self.drafter = build_drafter(drafter, self.target, runtime) if isinstance(drafter, str) else drafter
        if self.drafter.vocab_size is not None and self.drafter.vocab_size != self.backend.vocab_size:
            raise VocabularyMismatchError(
                f"the draft's vocabulary has {self.drafter.vocab_size} tokens but the target's has "
                f"{self.backend.vocab_size}: use a draft built for this target (same tokenizer), a draft model "
                "with a tokenizer (it is then re-tokenized), or --draft prompt-lookup"
            )
        self.eos_ids = self.target.eos_ids
        self._ignorable: frozenset[int] | None = None
        self._embedder: SentenceEmbedder | None = None
        self._draft_cost: dict[int, float] = {}  # by branches
        self._busy = False  # a single-sequence run is decoding on self.backend and self.drafter
        self._lock = threading.Lock()  # completions may start on several threads

    @classmethod
    def from_profile(cls, profile: str | Path | Profile, target: str | LoadedModel | Target | None = None) -> Generator:
        """A Generator in the configuration a `specdec tune` profile names (runtime, drafter, k settings, batch window).

        ``target`` replaces the profile's own (a ready model, or another name); a profile tuned for another target
        or on another machine still loads, with a ProfileWarning that says what differs.
        """
        if isinstance(profile, Profile):
            profile.check_installed()
        else:
            profile = load_profile(profile)
        name = target if isinstance(target, str) else profile.target if target is None else target.name
        for note in profile.differences(name):
            warnings.warn(note, ProfileWarning, stacklevel=2)
        return cls(
            profile.target if target is None else target,
            profile.drafter,
            profile.generation,
            profile.runtime,
            profile.batch,
        )

    def ignorable(self) -> frozenset[int]:
        """Token ids that are only whitespace or punctuation (never a loop on their own); computed on first use."""
        if self._ignorable is None:
            self._ignorable = ignorable_tokens(self.tokenizer) if self.tokenizer is not None else frozenset()
        return self._ignorable

    def embedder(self) -> SentenceEmbedder:
        """The sentence-embedding model of the drift monitor, loaded on first use."""
        if self._embedder is None:
            self._embedder = SentenceEmbedder()
        return self._embedder

    def costs(self) -> CostCurve:
        """The target's forward cost curve on this machine (measured on first use, cached on disk)."""
        with self._measuring:  # completions starting together on several threads measure once, not against each other
            if self._costs is None:
                self._costs = machine_cost_curve(_quiet_copy(self.backend))
        return self._costs

    def tree_overhead(self) -> CostCurve:
        """A tree forward's seconds over a chain's on the backend single sequences draft trees on (measured on first use, cached on disk)."""
        with self._measuring:
            if self._tree_overhead is None:
                self._tree_overhead = machine_tree_overhead(self.sequence_rows(_quiet_copy(self.backend), trees=True))
        return self._tree_overhead

    def sequence_rows(self, backend: Backend, trees: bool) -> RowBackend:
        """The cache one sequence decodes in on ``backend``: its own; for trees on transformers' plain cache (which keeps
        chains only), a batched cache of one row over the same weights."""
        if trees and not getattr(backend, "trees", False):
            return BatchedTransformersBackend(backend.model, cuda_graphs=self.batch.cuda_graphs)
        return OneRow(backend)

    def draft_cost(self, branches: int = 1) -> float:
        """Seconds of one draft step, drafting ``branches`` nodes a level (measured on first use, then cached): the draft
        model's one-token forward, the drafter's own measure for a model outside a Backend (the eagle head, whose tree
        levels cost more than a chain's), 0 for model-free drafters."""
        measured = hasattr(self.drafter, "measure_step")
        branches = (
            branches if measured else 1
        )  # a draft model's step is its one-token forward, however many nodes a level
        with self._measuring:
            if branches not in self._draft_cost:
                backend = getattr(
                    self.drafter, "backend", None
                )  # drafters written before the attribute existed count as free
                if backend is not None:
                    self._draft_cost[branches] = machine_cost_curve(_quiet_copy(backend))(1)
                elif measured:
                    self._draft_cost[branches] = machine_draft_step(self.drafter, branches)
                else:
                    self._draft_cost[branches] = 0.0
        return self._draft_cost[branches]

    def k_policy(self, config: GenerationConfig, batched: bool = False) -> KPolicy:
        """A fresh k policy for one sequence (a row of a batch decoder's, ``batched``). With a seed, the cost model prices
        drafts from measured (cached) costs, not live timings, so the seed reproduces the output. Without, a tree row
        shares the tree and chain steps' rates its generator's rows timed with the same settings (a batch row's steps are
        timed with the batch, so apart from single runs'); a seeded row's choices must not depend on earlier requests."""
        trees = config.branches > 1
        draft_cost = self.draft_cost if config.seed is not None else None
        tree_draft_cost = (lambda: self.draft_cost(config.branches)) if trees and config.seed is not None else None
        ways = None
        if trees and config.seed is None:
            ways = self._ways.setdefault((config.k, config.branches, config.sampling.greedy, batched), WayRates())
        return build_k_policy(
            config.k_policy,
            config.k,
            self.costs,
            draft_cost,
            self.tree_overhead if trees else None,
            ways,
            tree_draft_cost,
        )

    def acquire(self) -> tuple[Backend, Drafter]:
        """The target cache and drafter for a single-sequence run: this Generator's own, or forks of them while another run holds those."""
        with self._lock:
            if not self._busy:
                self._busy = True
                return self.backend, self.drafter
        forks = []
        for part, name in ((self.backend, "target"), (self.drafter, "drafter")):
            try:
                forks.append(part.fork())
            except ConfigError:
                raise ConfigError(
                    f"another completion of this Generator is still decoding, and its {name} decodes one sequence at a time: "
                    "finish or close the first one, or use a second Generator"
                ) from None
        return forks[0], forks[1]

    def release(self, backend: Backend) -> None:
        """A run that decoded on ``backend`` ended."""
        if backend is self.backend:
            with self._lock:
                self._busy = False

    def completion(
        self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object
    ) -> Completion:
        """A generation of ``prompt`` (text, or token ids), checked and encoded, not yet decoded."""
        return Completion(self, prompt, with_overrides(config or self.config, **overrides))

    def generate(
        self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, or token ids) and return it with stats."""
        run = self.completion(prompt, config, **overrides)
        for _ in run:
            pass
        return run.result()

    def stream(
        self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object
    ) -> Iterator[str]:
        """Yield pieces of text as the target accepts tokens."""
        yield from self.completion(prompt, config, **overrides)

    def generate_batch(
        self,
        prompts: Sequence[str | list[int]],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        decoder: Decoder | None = None,
        **overrides: object,
    ) -> list[GenerationResult]:
        """Generate completions of many prompts together (one target forward per step for all); results in prompt order.

        ``config`` is one config for every prompt or one per prompt; keyword
        overrides apply to all. Each row stops on its own (EOS, stop string,
        max_new_tokens) and leaves the batch. The window follows ``self.batch``
        unless a ``decoder`` from :meth:`batch_decoder` is passed (its reports then record each step).
        """
        configs = list(config) if isinstance(config, Sequence) else [config or self.config] * len(prompts)
        if len(configs) != len(prompts):
            raise ConfigError(
                f"got {len(configs)} configs for {len(prompts)} prompts: pass one config, or one per prompt"
            )
        if len(prompts) > 1 and not isinstance(self.backend, TransformersBackend):
            raise ConfigError(
                "batched generation runs on the transformers backend: use --backend transformers, or generate one prompt at a time"
            )
        runs = [self.completion(prompt, c, **overrides) for prompt, c in zip(prompts, configs, strict=True)]
        decoder = decoder if decoder is not None else self.batch_decoder()
        try:
            for run in runs:
                self.admit(decoder, run)
            while any(run in decoder.rows for run in runs):
                decoder.step()
        finally:  # a failure leaves a passed-in decoder without these runs
            for run in runs:
                decoder.leave(run)
        return [run.result() for run in runs]

    def batch_decoder(self) -> Decoder:
        """A decoder over this target's weights for sequences that join and leave between steps (the server's engine).

        On a single-sequence backend (native, llama.cpp) it holds one row at a time (``OneRow``; its ``max_rows``).
        """
        if not isinstance(self.backend, TransformersBackend):
            return Decoder(OneRow(self.backend.fork()))
        backend = BatchedTransformersBackend(self.backend.model, cuda_graphs=self.batch.cuda_graphs)
        if self.batch.window == "fixed":
            return Decoder(backend)
        memory = partial(memory_in_use, backend.device)
        window = LoadWindow(machine_batch_cost_curve(backend), self.batch.memory_threshold, memory)
        return Decoder(backend, window)

    def admit(self, decoder: Decoder, run: Completion) -> None:
        """Add ``run`` to a batch ``decoder`` with a forked drafter and a fresh k policy."""
        drafter = self.drafter.fork()  # first: a drafter that cannot fork is refused before anything is measured on it
        decoder.join(run, drafter, self.k_policy(run.config, batched=True))

    def encode(self, prompt: str | list[int]) -> list[int]:
        """``prompt``'s token ids, checked: not empty, valid text or in-vocabulary ids, within the context."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty: pass some text to continue")
            self._check_text(prompt, "the prompt")
            ids = self._tokenizer_for("text")(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if not ids:
                raise PromptError("the prompt is empty: pass at least one token id")
            bad = [t for t in ids if not 0 <= t < self.backend.vocab_size]
            if bad:
                raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{self.backend.vocab_size - 1})")
        return self._fits(ids, "prompt")

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Chat ``messages`` (OpenAI's role/content dicts, content as text) in the target's chat template, tokenized and checked."""
        tokenizer = self._tokenizer_for("chat messages")
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(
                f"model '{self.target.name}' has no chat template: send a plain prompt (a completion) instead"
            )
        for i, message in enumerate(messages):
            for field, value in message.items():  # content, and whatever else the template reads (name, tool fields)
                self._check_text(
                    json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value,
                    f"message {i}'s {field}",
                )
        self._check_text("".join(str(m.get("content", "")) for m in messages), "the messages together")
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (roles, order) raises what it likes
            raise PromptError(f"the chat template rejected these messages: {str(exc)[:200]}") from None
        return self._fits(list(ids), "messages")

    def _tokenizer_for(self, what: str):
        if self.tokenizer is None:
            raise PromptError(f"model '{self.target.name}' has no tokenizer to encode {what}: pass token ids instead")
        return self.tokenizer

    def _check_text(self, text: str, what: str) -> None:
        """Refuse text a tokenizer would choke on (lone surrogates) or that cannot fit the context, before spending time tokenizing it."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(
                f"{what} is not valid Unicode: a lone surrogate ({text[exc.start]!a}) at character {exc.start}: send well-formed text"
            ) from None
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ContextLengthError(
                f"{what} has {len(text)} characters, more than model '{self.target.name}' can hold in its context of "
                f"{self.backend.max_context} tokens (at most {self.max_prompt_chars}: no token is longer than "
                f"{self.max_prompt_chars // self.backend.max_context} characters): shorten it"
            )

    @cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt can have and still fit the context: the context times the longest token's characters.

        None where the tokenizer does not list its vocabulary (llama.cpp's): then only the token count is checked.
        """
        vocab = getattr(self.tokenizer, "get_vocab", None)
        return None if vocab is None else self.backend.max_context * max(map(len, vocab()))

    def _fits(self, ids: list[int], field: str) -> list[int]:
        if len(ids) >= self.backend.max_context:
            raise ContextLengthError(
                f"the {field} has {len(ids)} tokens but model '{self.target.name}' has a context of "
                f"{self.backend.max_context}: shorten the {field}"
            )
        return ids


def _quiet_copy(backend: Backend) -> Backend:
    """A backend to measure costs on without touching ``backend``'s cache: a fork, or the backend itself where it cannot fork
    (llama.cpp, which also refuses a second live completion, so nobody else is using it)."""
    try:
        return backend.fork()
    except ConfigError:
        return backend


class Completion:
    """One generation: iterating decodes it alone and yields text deltas; :meth:`result` gives the outcome afterwards.

    In a batch (:meth:`Generator.admit`) the decoder decodes it with others, handing
    each step's tokens to :meth:`take` and calling :meth:`close` when it ends.
    """

    def __init__(self, generator: Generator, prompt: str | list[int], config: GenerationConfig) -> None:
        if config.stop and generator.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer, and this model has none")
        if (
            config.branches > 1
            and not getattr(generator.backend, "trees", False)
            and not isinstance(generator.backend, TransformersBackend)
        ):
            raise ConfigError(TREES_UNSUPPORTED)
        self.generator = generator
        self.config = config
        self.prompt_ids = generator.encode(prompt)
        self.stats = DecodeStats()
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason = "length"
        self.text = TextTracker(generator.tokenizer, config.stop) if generator.tokenizer is not None else None
        self.seeds = Seeds(config.seed if config.seed is not None else random.randrange(2**63))
        guards = config.guards
        ignorable = generator.ignorable() if guards.repetition else frozenset()
        self.guards = Guards(guards, len(self.prompt_ids), ignorable) if guards.active else NoGuards()
        if guards.drift_threshold is not None:
            if generator.tokenizer is None:
                raise ConfigError("the drift monitor compares text, and this model has no tokenizer")
            self.embedder = generator.embedder()
            self.prompt_text = generator.tokenizer.decode(self.prompt_ids, skip_special_tokens=True)

    def __iter__(self) -> Iterator[str]:
        """Decode alone: the same step as a batch, on this Generator's own (or a forked) single-sequence backend."""
        gen = self.generator
        backend, drafter = gen.acquire()
        try:
            decoder = Decoder(gen.sequence_rows(backend, trees=self.config.branches > 1))
            decoder.join(
                self, drafter, gen.k_policy(self.config)
            )  # after acquiring: a first measurement must not disturb another run's cache
            while decoder.rows:
                for update in decoder.step():
                    if update.text:
                        yield update.text
        finally:
            gen.release(backend)

    def take(self, ids: list[int]) -> str:
        """Add the tokens one step accepted; return the text they complete. Ends the run at EOS or a stop string (the stats then count only what was kept)."""
        if self.config.stop_on_eos:
            eos_at = next((i for i, t in enumerate(ids) if t in self.generator.eos_ids), None)
            if eos_at is not None:
                ids = ids[: eos_at + 1]
                self.finish_reason = "eos"
        if self.text is not None:
            ids = self.text.add(ids)
            if self.text.stopped:
                self.finish_reason = "stop"
        self.stats.keep_emitted(len(ids))
        before = len(self.token_ids)
        self.token_ids += ids
        if self.config.guards.drift_threshold is not None:
            self._watch_drift(before)
        return self.text.delta(final=self.ended) if self.text is not None else ""

    def _watch_drift(self, before: int) -> None:
        """Score each window completed since ``before`` tokens against the prompt; below the threshold, a drift event (and an anchor)."""
        guards = self.config.guards
        size = guards.drift_window
        start = time.perf_counter()
        for end in range(size * (before // size + 1), len(self.token_ids) + 1, size):
            window = self.generator.tokenizer.decode(self.token_ids[end - size : end], skip_special_tokens=True)
            similarity = self.embedder.similarity(self.prompt_text, [window])[0]
            if similarity < guards.drift_threshold:  # type: ignore[operator]
                self.stats.events.append({"kind": "drift", "at": end, "similarity": round(similarity, 4)})
                if guards.drift_anchor:
                    self.guards.anchor_requested = True  # type: ignore[union-attr]  # drift is a guard: self.guards is Guards
        self.stats.guard_s += time.perf_counter() - start

    @property
    def ended(self) -> bool:
        """EOS or a stop string ended the run (the token budget and the context are the decoder's limits)."""
        return self.finish_reason != "length"

    def close(self) -> str:
        """Settle the outcome after the last step; return any text held back for a possible stop string."""
        if not self.ended and len(self.token_ids) < self.config.max_new_tokens:
            self.finish_reason = "context"
        return self.text.delta(final=True) if self.text is not None else ""

    def result(self) -> GenerationResult:
        text = self.text.text if self.text is not None else ""
        return GenerationResult(text, self.token_ids, self.stats, self.finish_reason)
