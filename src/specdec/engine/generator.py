"""The library entry point: a target, a drafter and a config; prompts in, text and stats out."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from functools import partial
from pathlib import Path

import torch

from specdec.config import (
    MAX_LOGPROBS,
    BatchConfig,
    GenerationConfig,
    GuardConfig,
    RuntimeConfig,
    SamplingConfig,
    with_overrides,
)
from specdec.drafters import Drafter, auto_draft, build_drafter, drafter_name
from specdec.engine.completion import Completion, GenerationResult
from specdec.engine.costs import MachineCosts
from specdec.engine.decoder import Decoder, Update
from specdec.engine.prompts import PromptEncoder
from specdec.engine.text import TextTracker
from specdec.errors import ConfigError, VocabularyMismatchError
from specdec.grammar import GrammarCompiler
from specdec.guards import DriftMonitor, Guards, NoGuards, ignorable_tokens
from specdec.models import DEFAULT_TARGET, Backend, LoadedModel, Target, open_target
from specdec.models.backend import TREES_UNSUPPORTED
from specdec.profile import Profile, ProfileWarning, load_profile
from specdec.quality import SentenceEmbedder
from specdec.scheduling import CostCurve, DynamicKCap, KPolicy, WayRates, build_k_policy, memory_in_use
from specdec.verification.logprobs import TokenLogprob, token_logprobs
from specdec.verification.processors import check_vocabulary

SCORE_CHUNK = 64  # prompt positions per forward when scoring a prompt: the logits of each chunk are [64, V] at most

__all__ = ["Completion", "GenerationResult", "Generator"]


def concrete_draft(spec: str | Drafter, target: Target, measured: MachineCosts) -> str | Drafter:
    """``auto`` made concrete for ``target`` from this machine's ``measured`` costs (drafters.auto_draft); any other
    drafter as it is."""
    if spec != "auto":
        return spec
    return auto_draft(target, measured.forward, measured.draft_step)


class Generator:
    """Speculative text generation whose output is the target's own.

    ``target`` and ``drafter`` are names (``"gemma-3-270m"``, ``"prompt-lookup"``,
    ``"model:PATH"``) or ready objects; ``runtime`` says where named models run
    (transformers or llama.cpp, dtype, threads); ``config`` holds the defaults
    that keyword arguments of :meth:`generate` and :meth:`stream` override;
    ``batch`` sets how :meth:`generate_batch` caps every row's k (the batch's k_cap).
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
        self.target = open_target(target, runtime)
        self.tokenizer = self.target.tokenizer
        self.backend = self.target.backend
        self.prompts = PromptEncoder(
            self.tokenizer, self.target.name, self.backend.vocab_size, self.backend.max_context
        )
        self.measured = MachineCosts(self.backend, self.batch.cuda_graphs)
        # Timed tree rows' rates of tree and chain steps, by k, branches, greedy, batched.
        self._ways: dict[tuple[int, int, bool, bool], WayRates] = {}
        drafter = concrete_draft(drafter, self.target, self.measured)
        self.draft_name = drafter_name(drafter)  # what drafts (``auto`` resolved)
        self.drafter = build_drafter(drafter, self.target, runtime)
        if self.drafter.vocab_size is not None and self.drafter.vocab_size != self.backend.vocab_size:
            raise VocabularyMismatchError(
                f"the draft's vocabulary has {self.drafter.vocab_size} tokens but the target's has "
                f"{self.backend.vocab_size}: use a draft built for this target (same tokenizer), a draft model "
                "with a tokenizer (it is then re-tokenized), or --draft prompt-lookup"
            )
        self.eos_ids = self.target.eos_ids
        self.grammars = GrammarCompiler(self.tokenizer, self.eos_ids)  # structured output's, built on first use
        self._ignorable: frozenset[int] | None = None
        self._embedder: SentenceEmbedder | None = None
        self._busy = False  # a single-sequence run is decoding on self.backend and self.drafter
        self._lock = threading.Lock()  # completions may start on several threads

    @classmethod
    def from_profile(cls, profile: str | Path | Profile, target: str | LoadedModel | Target | None = None) -> Generator:
        """A Generator in the configuration a `specdec tune` profile names (runtime, drafter, k settings, k_cap).

        ``target`` replaces the profile's own (a ready model, or another name); a profile tuned for another target
        or on another machine still loads, with a ProfileWarning that says what differs.
        """
        if isinstance(profile, str | Path):
            profile = load_profile(profile)
        else:
            profile.check_installed()
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
        return self.measured.forward()

    def tree_overhead(self) -> CostCurve:
        """A tree forward's seconds over a chain's where single sequences draft trees (measured on first use)."""
        return self.measured.tree_overhead()

    def draft_cost(self, branches: int = 1) -> float:
        """Seconds of one of this Generator's draft steps drafting ``branches`` nodes a level
        (MachineCosts.draft_step)."""
        return self.measured.draft_step(self.drafter, branches)

    def k_policy(self, config: GenerationConfig, batched: bool = False) -> KPolicy:
        """A fresh k policy for one sequence (a row of a batch decoder's, ``batched``). With a seed, the cost model
        prices drafts from measured (cached) costs, not live timings, so the seed reproduces the output. Without, a tree
        row shares the tree and chain steps' rates its generator's rows timed with the same settings (a batch row's
        steps are timed with the batch, so apart from single runs'); a seeded row's choices must not depend on earlier
        requests."""
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
        """The target cache and drafter for a single-sequence run: this Generator's own, or forks of them while another
        run holds those."""
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
                    f"another completion of this Generator is still decoding, "
                    f"and its {name} decodes one sequence at a time: "
                    "finish or close the first one, or use a second Generator"
                ) from None
        return forks[0], forks[1]

    def release(self, backend: Backend) -> None:
        """A run that decoded on ``backend`` ended."""
        if backend is self.backend:
            with self._lock:
                self._busy = False

    def score(self, prompt: str | list[int], top: int = 0) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given the tokens before it, with its ``top`` likeliest alternatives:
        the target's own distribution (no bias, penalties or temperature), from forwards over the prompt in chunks of
        SCORE_CHUNK positions. The first token follows nothing: None."""
        if not 0 <= top <= MAX_LOGPROBS:
            raise ConfigError(f"top alternatives must be between 0 and {MAX_LOGPROBS}, got {top}")
        ids = self.encode(prompt)
        scored: list[TokenLogprob | None] = [None]
        backend, _ = self.acquire()
        try:
            backend.reset()
            with torch.inference_mode():
                for start in range(0, len(ids) - 1, SCORE_CHUNK):
                    chunk = ids[start : start + SCORE_CHUNK]
                    logits = backend.forward(torch.tensor([chunk]))[0]
                    following = ids[start + 1 : start + 1 + len(chunk)]
                    scored += token_logprobs(logits[: len(following)], torch.tensor(following), top)
        finally:
            backend.reset()
            self.release(backend)
        return scored

    def completion(
        self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object
    ) -> Completion:
        """A generation of ``prompt`` (text, or token ids), checked and encoded, not yet decoded."""
        config = with_overrides(config or self.config, **overrides)
        if config.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer, and this model has none")
        if config.branches > 1 and not self.backend.capabilities.trees:
            raise ConfigError(TREES_UNSUPPORTED)
        self.check_sampling(config.sampling)
        prompt_ids = self.encode(prompt)
        guards, drift = self._guards(config.guards, prompt_ids)
        return Completion(
            prompt_ids,
            config,
            constraint=self.grammars.constraint(config.grammar),
            eos_ids=self.eos_ids,
            text=TextTracker(self.tokenizer, config.stop) if self.tokenizer is not None else None,
            guards=guards,
            drift=drift,
            alone=self._alone,
        )

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raise ConfigError where ``sampling`` names tokens this target's vocabulary lacks (``logit_bias``)."""
        check_vocabulary(sampling, self.backend.vocab_size)

    def _guards(self, config: GuardConfig, prompt_ids: list[int]) -> tuple[Guards | NoGuards, DriftMonitor | None]:
        """A generation's guards and, with a drift threshold, its drift monitor."""
        if not config.active:
            return NoGuards(), None
        guards = Guards(config, len(prompt_ids), self.ignorable() if config.repetition else frozenset())
        if config.drift_threshold is None:
            return guards, None
        if self.tokenizer is None:
            raise ConfigError("the drift monitor compares text, and this model has no tokenizer")
        decode = partial(self.tokenizer.decode, skip_special_tokens=True)
        return guards, DriftMonitor(guards, decode(prompt_ids), decode, self.embedder())

    def generate(
        self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, or token ids) and return it with stats."""
        completion = self.completion(prompt, config, **overrides)
        for _ in completion:
            pass
        return completion.result()

    def stream(
        self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object
    ) -> Iterator[str]:
        """Yield pieces of text as the target accepts tokens."""
        yield from self.completion(prompt, config, **overrides)

    def generate_batch(
        self,
        prompts: Sequence[str | list[int]],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        decoder: Decoder[Completion] | None = None,
        **overrides: object,
    ) -> list[GenerationResult]:
        """Generate completions of many prompts together (one target forward per step for all); results in prompt order.

        ``config`` is one config for every prompt or one per prompt; keyword
        overrides apply to all. Each row stops on its own (EOS, stop string,
        max_new_tokens) and leaves the batch. The k_cap follows ``self.batch``
        unless a ``decoder`` from :meth:`batch_decoder` is passed (its reports then record each step).
        """
        configs = list(config) if isinstance(config, Sequence) else [config or self.config] * len(prompts)
        if len(configs) != len(prompts):
            raise ConfigError(
                f"got {len(configs)} configs for {len(prompts)} prompts: pass one config, or one per prompt"
            )
        if len(prompts) > 1 and self.backend.capabilities.max_rows == 1:
            raise ConfigError(
                "this runtime decodes one sequence at a time (llama.cpp): batch on --runtime native or transformers, "
                "or generate one prompt at a time"
            )
        completions = [self.completion(prompt, c, **overrides) for prompt, c in zip(prompts, configs, strict=True)]
        decoder = decoder if decoder is not None else self.batch_decoder(len(prompts))
        for _ in self._decode(decoder, completions, partial(self.admit, decoder)):
            pass
        return [completion.result() for completion in completions]

    def _alone(self, completion: Completion) -> Iterator[str]:
        """Decode ``completion`` alone (what iterating it does): on this Generator's own single-sequence backend and
        drafter, or forks of them while another run holds those; yield its text as it comes."""
        backend, drafter = self.acquire()
        try:
            trees = completion.config.branches > 1
            decoder: Decoder[Completion] = Decoder(
                backend.row_backend(batch=False, trees=trees, cuda_graphs=self.batch.cuda_graphs)
            )
            # the k policy after acquiring: a first measurement must not disturb another run's cache
            join = partial(decoder.join, drafter=drafter, policy=self.k_policy(completion.config))
            with closing(self._decode(decoder, [completion], join)) as updates:  # abandoned: it leaves before release
                for update in updates:
                    if update.text:
                        yield update.text
        finally:
            self.release(backend)

    @staticmethod
    def _decode(
        decoder: Decoder[Completion], completions: list[Completion], join: Callable[[Completion], None]
    ) -> Iterator[Update[Completion]]:
        """The decoding loop of this Generator's runs, alone or in a batch: each of ``completions`` joins ``decoder``
        (``join``), which then steps until they all ended; yields each step's updates. Whatever ends it (a failure, an
        abandoned iterator), they leave the decoder (their drafters still hear that they ended)."""
        try:
            for completion in completions:
                join(completion)
            while any(completion in decoder.rows for completion in completions):
                yield from decoder.step()
        finally:  # a failure leaves a passed-in decoder without these completions
            for completion in completions:
                decoder.leave(completion)

    def batch_decoder(self, max_rows: int | None = None) -> Decoder[Completion]:
        """A decoder over this target's weights for sequences that join and leave between steps (the server's engine),
        its dynamic k_cap priced for batches of up to ``max_rows`` rows (None: any; fewer rows are measured faster).

        On a runtime that holds one sequence per forward (llama.cpp) it holds one row at a time
        (``capabilities.max_rows``).
        """
        rows = self.backend.row_backend(batch=True, trees=True, cuda_graphs=self.batch.cuda_graphs)
        if self.batch.k_cap == "fixed" or rows.capabilities.max_rows == 1:
            return Decoder(rows)
        memory = partial(memory_in_use, rows.device)
        costs = self.measured.batch(rows, max_rows)
        return Decoder(rows, DynamicKCap(costs, self.batch.memory_threshold, memory))

    def admit(self, decoder: Decoder[Completion], completion: Completion) -> None:
        """Add ``completion`` to a batch ``decoder`` with a forked drafter and a fresh k policy."""
        drafter = self.drafter.fork()  # first: a drafter that cannot fork is refused before anything is measured on it
        decoder.join(completion, drafter, self.k_policy(completion.config, batched=True))

    def encode(self, prompt: str | list[int]) -> list[int]:
        """``prompt``'s token ids, checked: not empty, valid text or in-vocabulary ids, within the context."""
        return self.prompts.encode(prompt)

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat ``messages`` (OpenAI's role/content dicts) in the target's chat template, with the ``tools`` it may call
        (OpenAI's function definitions), tokenized and checked."""
        return self.prompts.chat_ids(messages, tools)

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt can have and still fit the context (None: only token counts are checked)."""
        return self.prompts.max_prompt_chars
