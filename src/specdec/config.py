"""Typed configuration shared by the library, the CLI, the benchmark and the server."""

from __future__ import annotations

import math
import warnings
from dataclasses import InitVar, dataclass, field, fields, replace

from specdec.errors import ConfigError

MAX_K = 32
MAX_BRANCHES = 8
# "prompt-lookup+tree" (bench methods, profiles): the drafter proposes trees of up to TREE_BRANCHES children
TREE_SUFFIX = "+tree"
TREE_BRANCHES = 4
MAX_LOGPROBS = 20  # alternatives reported per token (OpenAI's chat limit)
MAX_PENALTY = 2.0  # presence and frequency penalties' bound (OpenAI's)
MAX_REPETITION_PENALTY = 100.0
MAX_BIAS = 100.0  # logit_bias values' bound (OpenAI's)
MIN_TEMPERATURE = 1e-6  # below it, logits / temperature overflow float32 to inf (and probabilities to NaN)
K_POLICIES = ("fixed", "heuristic", "perplexity", "confidence", "cost-model")
# every command's drafter: the fastest measured for the target (drafters.build_drafter says which)
DEFAULT_DRAFT = "auto"


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. ``temperature == 0`` means greedy.

    The target's logits at every position pass, in this order, through ``logit_bias`` (added), ``repetition_penalty``
    (a token already in the prompt or output: a positive logit divided by it, a negative one multiplied),
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's: minus count x frequency_penalty, minus presence_penalty
    once, counting the output's tokens), then temperature, ``top_k``, ``top_p`` and ``min_p`` (a token less likely than
    min_p times the likeliest is dropped). verification/processors.py and shaping.py apply them.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, each id once

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(
                f"temperature must be 0 (greedy) or finite and at least {MIN_TEMPERATURE}, got {self.temperature}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1 or unset, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ConfigError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY or not math.isfinite(self.repetition_penalty):
            raise ConfigError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 is off), got {self.repetition_penalty}"
            )
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ConfigError("logit_bias names a token more than once: give each token id one bias")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ConfigError(f"logit_bias token ids are >= 0, got {token}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ConfigError(
                    f"logit_bias values must be in [-{MAX_BIAS}, {MAX_BIAS}], got {bias} for token {token}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether the target's logits pass through bias or penalties before temperature (processors.py)."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


# The guards' sizes in tokens, each (least, most). A server takes them from clients and runs every request on one
# thread (the loop search's work per token grows with loop_max_unit, the n-grams' with block_ngram), so each has a
# ceiling, generous for real text: loops of a few paragraphs at most.
MAX_GUARD_TOKENS = 1 << 24  # past any model's context: a period this long never comes round
GUARD_BOUNDS: dict[str, tuple[int, int]] = {
    "loop_repeats": (2, 16),
    "loop_min_span": (2, 4096),
    "loop_max_unit": (1, 256),
    "loop_cooldown": (1, 4096),
    "block_ngram": (1, 32),
    "schedule_tokens": (1, MAX_GUARD_TOKENS),
    "anchor_every": (1, MAX_GUARD_TOKENS),
    "drift_window": (1, MAX_GUARD_TOKENS),
}


@dataclass(frozen=True)
class GuardConfig:
    """Long-generation guards (guards.py), each off by default.

    Every guard is a function of the tokens so far, so the engine applies it to
    the target's logits at each verified position exactly as target-only
    decoding would: speculative output stays the guarded target's own.
    """

    # from a detected loop on, for loop_cooldown tokens, block every token that repeats an n-gram of the output
    repetition: bool = False
    loop_repeats: int = 3  # a loop: the output ends in this many copies of one unit ...
    loop_min_span: int = 24  # ... covering at least this many tokens (shorter repeats are legitimate)
    loop_max_unit: int = 64  # longest unit looked for, in tokens
    loop_cooldown: int = 32  # tokens after a detected loop during which repeated n-grams stay blocked
    block_ngram: int = 4  # n of the blocked n-grams
    # (start, end): temperature over the output, e.g. (0.7, 1.2)
    temperature_schedule: tuple[float, float] | None = None
    schedule_tokens: int = 512  # the schedule reaches its end temperature after this many new tokens
    anchor_every: int | None = None  # one target-only step (and a drafter resync) every N new tokens
    drift_threshold: float | None = None  # report a drift event when a window's similarity to the prompt falls below
    drift_window: int = 100  # tokens per drift window
    drift_anchor: bool = False  # a drift event also triggers an anchor step

    def __post_init__(self) -> None:
        for name, (least, most) in GUARD_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not least <= value <= most:
                raise ConfigError(f"{name} must be between {least} and {most}, got {value}")
        if self.temperature_schedule is not None and (
            len(self.temperature_schedule) != 2
            or not all(math.isfinite(t) for t in self.temperature_schedule)  # NaN slips past the comparison below
            or min(self.temperature_schedule) < MIN_TEMPERATURE
        ):
            raise ConfigError(
                f"temperature_schedule is (start, end) with both >= {MIN_TEMPERATURE} and finite, "
                f"got {self.temperature_schedule}"
            )
        if self.drift_threshold is not None and not -1 <= self.drift_threshold <= 1:
            raise ConfigError(f"drift_threshold is a cosine similarity in [-1, 1], got {self.drift_threshold}")
        if self.drift_anchor and self.drift_threshold is None:
            raise ConfigError(
                "drift_anchor needs a drift_threshold (the similarity below which a window counts as drift)"
            )

    @property
    def active(self) -> bool:
        """Whether any guard is on (the other fields are their parameters)."""
        return (
            self.repetition
            or self.temperature_schedule is not None
            or self.anchor_every is not None
            or self.drift_threshold is not None
        )


@dataclass(frozen=True)
class TypicalAcceptance:
    """LOSSY typical acceptance (Medusa; vLLM's typical acceptance sampler): a draft token is accepted when the target
    gives it probability above min(epsilon, alpha * exp(-entropy)). Output no longer follows the target exactly."""

    epsilon: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if not 0 < self.epsilon <= 1 or not 0 < self.alpha <= 1:
            raise ConfigError(
                f"typical acceptance needs 0 < epsilon <= 1 and 0 < alpha <= 1, got {self.epsilon}, {self.alpha}"
            )


MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit integers (torch's generators take no more)


GRAMMAR_KINDS = ("json", "json_schema", "regex", "lark", "gbnf")


@dataclass(frozen=True)
class Grammar:
    """What the output must match: ``json`` (any JSON object), or a ``json_schema``, ``regex``, ``lark`` or ``gbnf``
    (llama.cpp's grammar format) given as ``source`` text (grammar.py enforces it)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ConfigError(f"unknown grammar kind '{self.kind}': use one of {', '.join(GRAMMAR_KINDS)}")
        if (self.kind == "json") == bool(self.source):
            raise ConfigError(
                "a json grammar takes no source (it is any JSON object)"
                if self.kind == "json"
                else f"a {self.kind} grammar needs its source text"
            )


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request: speculation depth, length, stopping, sampling, guards, and (only if asked) lossy
    acceptance."""

    k: int = 8  # draft tokens per step (a tree's nodes); the most per step for adaptive k policies
    # the most children of a draft node: 1 drafts chains; more lets tree drafters branch (verified in one forward)
    branches: int = 1
    k_policy: str = "cost-model"  # k chosen per step from measured costs and acceptance
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stop_on_eos: bool = True
    guards: GuardConfig = field(default_factory=GuardConfig)
    typical_acceptance: TypicalAcceptance | None = None  # None: exact verification (the default); set: LOSSY
    # report each new token's log-probability and this many likeliest alternatives (verification/logprobs.py); None: off
    logprobs: int | None = None
    grammar: Grammar | None = None  # structured output: every token keeps the output inside it (grammar.py)

    def __post_init__(self) -> None:
        if self.grammar is not None and not self.stop_on_eos:
            raise ConfigError("a grammar ends its output with end-of-sequence: drop ignore_eos (stop_on_eos=False)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be between 0 and {MAX_LOGPROBS} (or unset), got {self.logprobs}")
        if self.guards.temperature_schedule is not None and self.sampling.greedy:
            raise ConfigError("a temperature schedule samples: set a temperature > 0 (the schedule then replaces it)")
        if not 1 <= self.k <= MAX_K:
            raise ConfigError(f"k (draft tokens per step) must be between 1 and {MAX_K}, got {self.k}")
        if not 1 <= self.branches <= MAX_BRANCHES:
            raise ConfigError(
                f"branches (children per draft node) must be between 1 and {MAX_BRANCHES}, got {self.branches}"
            )
        if self.branches > 1 and (self.guards.active or self.typical_acceptance is not None):
            raise ConfigError(
                "tree drafts (branches > 1) do not combine with guards or typical acceptance yet: set branches to 1"
            )
        if self.k_policy not in K_POLICIES:
            raise ConfigError(f"unknown k policy '{self.k_policy}': use one of {', '.join(K_POLICIES)}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in 0..{MAX_SEED} (64 bits), got {self.seed}")


K_CAPS = ("dynamic", "fixed")


@dataclass(frozen=True)
class BatchConfig:
    """How the batched engine caps each step's k for every row (the batch's k_cap).

    ``dynamic`` caps every row's k by the load (batch size, acceptance, memory;
    scheduling/k_cap.py's DynamicKCap); ``fixed`` leaves each row's k policy alone.
    """

    k_cap: str = "dynamic"
    memory_threshold: float = 0.8  # share of memory in use above which the dynamic k_cap turns speculation off
    # replay captured CUDA graphs for steps over the whole batch (CUDA only; nothing changes on a CPU)
    cuda_graphs: bool = True
    # deprecated: k_cap's former name, still accepted (BatchConfig(window=...), a profile's or Serve config's "window")
    window: InitVar[str | None] = None

    def __post_init__(self, window: str | None) -> None:
        if window is not None:
            if self.k_cap != "dynamic" and self.k_cap != window:
                raise ConfigError(f"BatchConfig got k_cap '{self.k_cap}' and window '{window}': give k_cap alone")
            warnings.warn("BatchConfig(window=...) is deprecated: use k_cap", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "k_cap", window)
        if self.k_cap not in K_CAPS:
            raise ConfigError(f"unknown k_cap '{self.k_cap}': use one of {', '.join(K_CAPS)}")
        if not 0 < self.memory_threshold <= 1:
            raise ConfigError(f"memory_threshold is a share of memory in (0, 1], got {self.memory_threshold}")


FORMATS = ("float32", "bfloat16", "float16", "int8", "int8a8", "float8")


@dataclass(frozen=True)
class PrecisionPlan:
    """The number format of the target's attention, FFN and output head, of the draft model, and of the logits the
    verifier reads.

    float32/bfloat16/float16 are the weights' and the compute's format; int8 and
    float8 are weight-only formats computed in bfloat16, int8a8 quantizes activations too and
    multiplies integers exactly (specdec.models.precision).
    ``verify`` is a float format: the target's logits are handed to the verifier in it.
    """

    attention: str = "float32"
    ffn: str = "float32"
    head: str = "float32"
    draft: str = "float32"
    verify: str = "float32"

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) not in FORMATS:
                raise ConfigError(f"precision {f.name}={getattr(self, f.name)}: use one of {', '.join(FORMATS)}")
        if self.verify not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"precision verify={self.verify}: verification logits are float32, bfloat16 or float16")

    @staticmethod
    def parse(spec: str) -> PrecisionPlan:
        """A preset name (see PRESETS) or ``attention=bfloat16,ffn=int8,head=bfloat16,draft=float8`` (unnamed parts:
        float32)."""
        if spec in RENAMED_PRESETS:
            warnings.warn(
                f"the precision preset '{spec}' is now called '{RENAMED_PRESETS[spec]}'; "
                f"'{spec}' will be removed in the next release",
                FutureWarning,
                stacklevel=2,
            )
            spec = RENAMED_PRESETS[spec]
        if spec in PRESETS:
            return PRESETS[spec]
        values: dict[str, str] = {}
        names = {f.name for f in fields(PrecisionPlan)}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key not in names or not value:
                raise ConfigError(
                    f"bad precision '{spec}': use a preset ({', '.join(PRESETS)}) or component=format pairs "
                    f"for {', '.join(sorted(names))} (formats: {', '.join(FORMATS)})"
                )
            values[key] = value
        return PrecisionPlan(**values)

    def describe(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


PRESETS: dict[str, PrecisionPlan] = {
    "fp32": PrecisionPlan(),
    "bf16": PrecisionPlan("bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16"),
    # The seed document's plan (its section 5.2): draft in fp8, attention in fp16, FFN in int8, verification in fp16.
    "fp8-draft": PrecisionPlan(attention="float16", ffn="int8", head="float16", draft="float8", verify="float16"),
    # bfloat16 everywhere but the FFN's int8: the fastest plan within the perplexity bound on the CPUs measured.
    "cpu": PrecisionPlan(attention="bfloat16", ffn="int8", head="bfloat16", draft="bfloat16"),
    # For CPUs with AVX-512 VNNI: the output head in exact int8 products, its weights read once per step (the native
    # backend is faster still). Elsewhere it runs, exactly but slowly.
    "cpu-vnni": PrecisionPlan(attention="bfloat16", ffn="int8", head="int8a8", draft="bfloat16"),
}
RENAMED_PRESETS = {"seed": "fp8-draft"}  # old name -> new: "seed" is the random seed's name


# native: specdec's own CPU runtime (Gemma-3, Llama, Mistral, Qwen2/3 models, int8 kernels, models/native/);
# auto: native where it runs, else transformers (the fastest exact target-only and speculation measured on CPU).
RUNTIMES = ("transformers", "llama.cpp", "native", "auto")
DTYPES = ("float32", "bfloat16", "float16")
NATIVE_FORMATS = ("auto", "int8", "int4")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how models run: the target's runtime, weight dtype, threads, llama.cpp micro-batch.

    ``auto`` runs the native backend where it runs the model, else transformers; a ``dtype`` other than float32 or a
    ``precision`` plan asks for transformers' formats, so ``auto`` then means transformers.
    """

    backend: str = "transformers"
    dtype: str = "float32"  # transformers weights
    threads: int | None = None  # llama.cpp threads; None = every core
    ubatch: int | None = None  # llama.cpp micro-batch; 1 = verification bit-identical to one-token decoding
    precision: PrecisionPlan | None = None  # per-component formats (transformers); replaces dtype when set
    native_format: str = "auto"  # native weights: int8, int4, or auto (the faster here, measured)

    def __post_init__(self) -> None:
        if self.backend not in RUNTIMES:
            raise ConfigError(f"unknown runtime '{self.backend}': use one of {', '.join(RUNTIMES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype '{self.dtype}': use one of {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.ubatch is not None and self.ubatch < 1:
            raise ConfigError(f"ubatch must be >= 1, got {self.ubatch}")
        if self.precision is not None and self.backend not in ("transformers", "auto"):
            raise ConfigError(
                "--precision plans apply to the transformers backend; llama.cpp's format is its GGUF file's "
                "quantization type and the native backend's is --native-format: use --runtime transformers"
            )
        if self.native_format not in NATIVE_FORMATS:
            raise ConfigError(f"unknown native format '{self.native_format}': use one of {', '.join(NATIVE_FORMATS)}")
        if self.native_format != "auto" and self.backend not in ("native", "auto"):
            raise ConfigError("--native-format applies to the native backend: use --runtime native or auto, or drop it")
        if self.dtype != "float32" and self.backend == "native":
            raise ConfigError(
                "--dtype applies to the transformers backend; the native backend's is --native-format: drop --dtype"
            )


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))


def with_overrides(config: GenerationConfig, **overrides: object) -> GenerationConfig:
    """A copy of ``config`` with flat keyword overrides (sampling keys go into ``config.sampling``)."""
    sampling = {key: overrides.pop(key) for key in SAMPLING_FIELDS if key in overrides}
    unknown = set(overrides) - {f.name for f in fields(GenerationConfig)}
    if unknown:
        raise ConfigError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    if "stop" in overrides and isinstance(overrides["stop"], str):
        overrides["stop"] = (overrides["stop"],)
    elif "stop" in overrides:
        overrides["stop"] = tuple(overrides["stop"])  # type: ignore[arg-type]
    base = overrides.pop("sampling", config.sampling)
    return replace(config, sampling=replace(base, **sampling), **overrides)  # type: ignore[arg-type]
