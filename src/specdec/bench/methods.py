"""Benchmark methods: specdec drafters, an oracle, and peer baselines, behind one small interface."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from transformers.generation.streamers import BaseStreamer

from specdec.config import TREE_BRANCHES, TREE_SUFFIX, GenerationConfig, RuntimeConfig
from specdec.drafters import DRAFT_SPECS
from specdec.drafters.base import Drafter, DraftSettings, Proposal
from specdec.engine import Generator
from specdec.errors import ConfigError
from specdec.models import LoadedModel, Target, load_model, resolve
from specdec.models.llamacpp import end_of_generation_ids, llama_cpp_problem
from specdec.models.precision import convert_draft
from specdec.models.target import gguf_path

PEER_METHODS = "hf-greedy, hf-prompt-lookup, hf-assisted:MODEL, llamacpp-greedy, llamacpp-prompt-lookup"
K_FREE_METHODS = ("none", "hf-greedy", "llamacpp-greedy")  # run once, whatever --k lists
PEER_PREFIXES = ("hf-", "llamacpp-")  # peers' own k schedules: run once per k, with no k policy


@dataclass
class RunRecord:
    """One generation of one prompt by one method."""

    token_ids: list[int]
    wall_s: float
    ttft_s: float | None = None
    draft_tokens_proposed: int | None = None
    draft_tokens_accepted: int | None = None
    target_steps: int | None = None  # target forwards, one per step
    draft_s: float | None = None
    verify_s: float | None = None  # the steps after the first, which also reads the prompt
    accepted_per_step: list[int] = field(default_factory=list)
    k_per_step: list[int] = field(default_factory=list)
    draft_s_per_step: list[float] = field(default_factory=list)


class Method(Protocol):
    name: str
    family: str  # "specdec", "transformers" or "llama.cpp"
    k: int | None
    k_policy: str | None
    learns: bool  # its drafts improve with the requests it has run (a suffix history): measured in one pass

    def run(self, prompt_ids: list[int], reference: list[int] | None) -> RunRecord:
        """Generate from ``prompt_ids``; ``reference`` is the target's own greedy output (for the oracle)."""
        ...


class OracleDrafter(Drafter):
    """Proposes the target's greedy continuation, computed beforehand, each token right with probability ``accuracy``.

    At accuracy 1 it is the engine's ceiling. Below 1, whether the token for position p is right is drawn from a
    generator seeded by (seed, p), so a rerun proposes the same; a wrong token is a neighbouring id. Acceptance is
    then controlled (the chance that a draft survives i positions is accuracy^i) while every timing stays real:
    the model-size benchmark runs it on random-weight models, whose text means nothing.
    """

    def __init__(self, accuracy: float = 1.0, seed: int = 0) -> None:
        if not 0 < accuracy <= 1:
            raise ConfigError(f"an oracle's accuracy is a probability in (0, 1], got {accuracy}")
        self.accuracy = accuracy
        self.seed = seed
        self.reference: list[int] = []

    def begin(self, settings: DraftSettings) -> None:
        pass

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        length = context.shape[0]
        if context.tolist() != self.reference[:length]:
            return Proposal.empty()
        tokens = self.reference[length : length + k]
        for i, token in enumerate(tokens):
            if self.accuracy < 1 and random.Random(f"{self.seed}:{length + i}").random() >= self.accuracy:
                tokens[i] = token - 1 if token > 0 else token + 1
        return Proposal(torch.tensor(tokens, dtype=torch.long))

    def fork(self) -> OracleDrafter:
        return self  # the reference is set per run; the benchmark decodes one sequence at a time


def oracle_accuracy(spec: str) -> float | None:
    """The accuracy of an oracle method ("oracle" is 1, "oracle:0.7" is 0.7), or None for any other method."""
    kind, _, arg = spec.partition(":")
    if kind != "oracle":
        return None
    try:
        accuracy = float(arg) if arg else 1.0
    except ValueError:
        accuracy = -1.0
    if not 0 < accuracy <= 1:
        raise ConfigError(f"'{spec}': an oracle's accuracy is a probability in (0, 1], for example oracle:0.7")
    return accuracy


class SpecdecMethod:
    family = "specdec"

    def __init__(self, spec: str, target: Target, config: GenerationConfig, runtime: RuntimeConfig) -> None:
        drafter_spec = spec.removesuffix(TREE_SUFFIX)
        if drafter_spec != spec:
            config = replace(config, branches=TREE_BRANCHES)
        self.k = config.k if spec != "none" else None
        self.k_policy = config.k_policy if spec != "none" else None
        if self.k is None:
            self.name = spec
        else:  # fixed k: "prompt-lookup@k4"; adaptive, with k its maximum: "prompt-lookup@cost-model-k8"
            policy = "" if config.k_policy == "fixed" else f"{config.k_policy}-"
            self.name = f"{spec}@{policy}k{config.k}"
        accuracy = oracle_accuracy(spec)
        self.oracle = OracleDrafter(accuracy, config.seed or 0) if accuracy is not None else None
        self.generator = Generator(target, self.oracle or drafter_spec, config, runtime)
        self.learns = self.generator.drafter.capabilities.learns

    def run(self, prompt_ids: list[int], reference: list[int] | None) -> RunRecord:
        if self.oracle is not None:
            self.oracle.reference = prompt_ids + (reference or [])
        result = self.generator.generate(prompt_ids)
        s = result.stats
        return RunRecord(
            token_ids=result.token_ids,
            wall_s=s.wall_s,
            ttft_s=s.ttft_s,
            draft_tokens_proposed=s.draft_tokens_proposed,
            draft_tokens_accepted=s.draft_tokens_accepted,
            target_steps=s.steps,
            draft_s=s.draft_s,
            verify_s=s.verify_s,
            accepted_per_step=list(s.accepted_per_step),
            k_per_step=list(s.k_per_step),
            draft_s_per_step=list(s.draft_s_per_step),
        )


class TransformersMethod:
    """transformers' own `generate`: greedy, prompt lookup, or assisted by a draft model."""

    family = "transformers"
    k_policy = None

    def __init__(self, spec: str, target: LoadedModel, config: GenerationConfig, runtime: RuntimeConfig) -> None:
        self.target = target
        self.config = config
        self.kwargs: dict[str, object] = {}
        self.k = None
        self.learns = False
        if spec == "hf-greedy":
            self.name = spec
        elif spec == "hf-prompt-lookup":
            self.k = config.k
            self.kwargs = {"prompt_lookup_num_tokens": config.k}
        else:  # hf-assisted:MODEL
            self.k = config.k
            assistant = load_model(spec.split(":", 1)[1], dtype="float32" if runtime.precision else runtime.dtype)
            if runtime.precision is not None:
                convert_draft(assistant.model, runtime.precision.draft)
            self.kwargs = {"assistant_model": assistant.model}
            if assistant.vocab_size != target.vocab_size:  # transformers' universal assisted decoding
                self.kwargs |= {"tokenizer": target.tokenizer, "assistant_tokenizer": assistant.tokenizer}
            assistant.model.generation_config.num_assistant_tokens = config.k
            assistant.model.generation_config.num_assistant_tokens_schedule = "constant"
        self.name = spec if self.k is None else f"{spec}@k{self.k}"

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], reference: list[int] | None) -> RunRecord:
        sampling = self.config.sampling
        options: dict[str, object] = {"do_sample": False}
        if not sampling.greedy:
            options = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k or 0,
            }
        ids = torch.tensor([prompt_ids])
        clock = _FirstTokenClock()
        out = self.target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=self.config.max_new_tokens,
            streamer=clock,
            **options,
            **self.kwargs,
        )
        wall = time.perf_counter() - clock.start
        return RunRecord(token_ids=out[0, len(prompt_ids) :].tolist(), wall_s=wall, ttft_s=clock.ttft_s)


class _FirstTokenClock(BaseStreamer):
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.calls = 0
        self.ttft_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1  # the first call carries the prompt, the second the first new token(s)
        if self.calls == 2:
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


class LlamaCppMethod:
    """llama-cpp-python's own generation on the target's GGUF file: greedy, or its prompt lookup."""

    family = "llama.cpp"
    k_policy = None

    def __init__(self, spec: str, gguf: str, config: GenerationConfig, runtime: RuntimeConfig) -> None:
        from specdec.models.llamacpp import require_llama_cpp

        llama_cpp = require_llama_cpp()  # probed before anything of llama.cpp loads in this process
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.config = config
        self.k = config.k if spec == "llamacpp-prompt-lookup" else None
        self.learns = False
        self.name = spec if self.k is None else f"{spec}@k{self.k}"
        draft = LlamaPromptLookupDecoding(num_pred_tokens=config.k) if self.k else None
        threads = runtime.threads or os.cpu_count() or 1
        self.llama = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=4096,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            verbose=False,
        )
        self.eog = end_of_generation_ids(self.llama)

    def run(self, prompt_ids: list[int], reference: list[int] | None) -> RunRecord:
        sampling = self.config.sampling
        options = (
            {"temp": 0.0}
            if sampling.greedy
            else {"temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or 0}
        )
        self.llama.reset()
        tokens: list[int] = []
        ttft = None
        start = time.perf_counter()
        for token in self.llama.generate(prompt_ids, reset=True, repeat_penalty=1.0, min_p=0.0, **options):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens.append(token)
            if token in self.eog or len(tokens) >= self.config.max_new_tokens:
                break
        return RunRecord(token_ids=tokens, wall_s=time.perf_counter() - start, ttft_s=ttft)


def build_method(
    spec: str, target: Target, hf_model: LoadedModel | None, config: GenerationConfig, runtime: RuntimeConfig
) -> Method:
    """Build a method whose name :func:`check_method` accepted."""
    if spec.startswith(PEER_PREFIXES[0]):
        assert hf_model is not None
        return TransformersMethod(spec, hf_model, config, runtime)
    if spec.startswith(PEER_PREFIXES[1]):
        return LlamaCppMethod(spec, gguf_path(target.name), config, runtime)
    return SpecdecMethod(spec, target, config, runtime)


def check_method(spec: str, target: str) -> str | None:
    """Validate a method name before loading anything; return a note when it must be skipped."""
    drafter = spec.removesuffix(TREE_SUFFIX)
    if drafter != spec and (
        drafter == "none" or oracle_accuracy(drafter) is not None or drafter.startswith(PEER_PREFIXES)
    ):
        raise ConfigError(
            f"'{spec}': {TREE_SUFFIX} goes after a specdec drafter (for example prompt-lookup{TREE_SUFFIX})"
        )
    spec = drafter
    kind, _, model = spec.partition(":")
    if oracle_accuracy(spec) is not None:
        return None
    if spec in (
        "auto",
        "none",
        "prompt-lookup",
        "suffix",
        "lookup-then-draft",
        "default",
        "eagle",
        "lookup-then-eagle",
        "hf-greedy",
        "hf-prompt-lookup",
    ):
        return None
    if kind in ("model", "gguf", "hf-assisted", "ngram", "layerskip") and model:
        return None
    if spec in ("llamacpp-greedy", "llamacpp-prompt-lookup"):
        if resolve(target).kind not in ("alias", "gguf"):
            return f"{spec} skipped: llama.cpp runs GGUF files, and the target '{target}' is not one"
        problem = llama_cpp_problem()
        return None if problem is None else f"{spec} skipped: {problem}"
    raise ConfigError(
        f"unknown method '{spec}': use a drafter ({DRAFT_SPECS}), oracle[:ACCURACY], or a peer ({PEER_METHODS})"
    )
