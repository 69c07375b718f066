"""`specdec generate` and `specdec demo`: text from one prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from specdec.cli.options import (
    FAST_BACKEND,
    Branches,
    Draft,
    Dtype,
    FastRuntimeOpt,
    KOpt,
    KPolicyOpt,
    NativeFormatOpt,
    Precision,
    ProfileOpt,
    Target,
    Threads,
    Ubatch,
    announce_runtime,
    console,
    default,
    err,
    float_pair,
    runtime_config,
    status,
    user_errors,
    with_profile,
)
from specdec.config import (
    DEFAULT_DRAFT,
    GenerationConfig,
    Grammar,
    GuardConfig,
    RuntimeConfig,
    SamplingConfig,
    TypicalAcceptance,
)
from specdec.errors import ConfigError, SpecDecError
from specdec.models import DEFAULT_TARGET

if TYPE_CHECKING:
    from specdec.engine import Generator


MaxNewTokens = Annotated[int, typer.Option(help="Most new tokens to generate.")]
Temperature = Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")]
TopK = Annotated[int | None, typer.Option(help="Keep only the k most likely tokens.")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")]
MinP = Annotated[float, typer.Option(help="Drop tokens less likely than this times the likeliest, in [0, 1].")]
PresencePenalty = Annotated[
    float, typer.Option(help="Subtracted once from the logit of every token the output holds (OpenAI's), in [-2, 2].")
]
FrequencyPenalty = Annotated[
    float, typer.Option(help="Subtracted per occurrence in the output from a token's logit (OpenAI's), in [-2, 2].")
]
RepetitionPenalty = Annotated[
    float,
    typer.Option(help="Tokens in the prompt or output: a positive logit divided by it, a negative multiplied; 1 off."),
]
LogitBias = Annotated[
    list[str] | None,
    typer.Option(help="TOKEN_ID=BIAS added to that token's logit, BIAS in [-100, 100] (repeatable)."),
]
Seed = Annotated[int | None, typer.Option(help="Random seed, for reproducible sampling.")]
Logprobs = Annotated[
    int | None,
    typer.Option(help="Report each token's log-probability and this many alternatives (0-20) in --json output."),
]
JsonSchema = Annotated[Path | None, typer.Option(help="A JSON schema file the output must match (structured output).")]
GrammarFile = Annotated[
    Path | None, typer.Option(help="A GBNF grammar file (llama.cpp's format) the output must match.")
]
Stop = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")]
Stream = Annotated[bool, typer.Option(help="Print text as it is accepted.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object with text, token_ids and stats.")]
RepetitionGuard = Annotated[
    bool, typer.Option(help="Guard: while the output ends in a loop, block the token that continues it.")
]
TemperatureSchedule = Annotated[
    str | None,
    typer.Option(
        help=f"Guard: temperature from START to END over {default(GuardConfig, 'schedule_tokens')} new tokens, "
        "e.g. 0.7,1.2 (needs --temperature > 0)."
    ),
]
AnchorEvery = Annotated[
    int | None, typer.Option(help="Guard: one target-only step and a drafter resync every N new tokens.")
]
DriftThreshold = Annotated[
    float | None,
    typer.Option(
        help=f"Guard: report drift when a {default(GuardConfig, 'drift_window')}-token window's similarity to the "
        "prompt falls below this."
    ),
]
DriftAnchor = Annotated[bool, typer.Option(help="A drift event also triggers an anchor step.")]
TypicalAcceptanceOpt = Annotated[
    bool,
    typer.Option(
        help="LOSSY: accept any plausible draft token (typical acceptance); output is no longer the target's own."
    ),
]


@user_errors
def generate(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="Text to continue.")],
    target: Target = DEFAULT_TARGET,
    draft: Draft = DEFAULT_DRAFT,
    k: KOpt = default(GenerationConfig, "k"),
    k_policy: KPolicyOpt = default(GenerationConfig, "k_policy"),
    branches: Branches = default(GenerationConfig, "branches"),
    max_new_tokens: MaxNewTokens = default(GenerationConfig, "max_new_tokens"),
    temperature: Temperature = default(SamplingConfig, "temperature"),
    top_k: TopK = default(SamplingConfig, "top_k"),
    top_p: TopP = default(SamplingConfig, "top_p"),
    min_p: MinP = default(SamplingConfig, "min_p"),
    presence_penalty: PresencePenalty = default(SamplingConfig, "presence_penalty"),
    frequency_penalty: FrequencyPenalty = default(SamplingConfig, "frequency_penalty"),
    repetition_penalty: RepetitionPenalty = default(SamplingConfig, "repetition_penalty"),
    logit_bias: LogitBias = None,
    seed: Seed = default(GenerationConfig, "seed"),
    stop: Stop = None,
    logprobs: Logprobs = None,
    json_schema: JsonSchema = None,
    grammar: GrammarFile = None,
    dtype: Dtype = default(RuntimeConfig, "dtype"),
    precision: Precision = None,
    backend: FastRuntimeOpt = FAST_BACKEND,
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
    threads: Threads = default(RuntimeConfig, "threads"),
    ubatch: Ubatch = default(RuntimeConfig, "ubatch"),
    stream: Stream = False,
    as_json: AsJson = False,
    repetition_guard: RepetitionGuard = default(GuardConfig, "repetition"),
    temperature_schedule: TemperatureSchedule = None,
    anchor_every: AnchorEvery = default(GuardConfig, "anchor_every"),
    drift_threshold: DriftThreshold = default(GuardConfig, "drift_threshold"),
    drift_anchor: DriftAnchor = default(GuardConfig, "drift_anchor"),
    typical_acceptance: TypicalAcceptanceOpt = False,
    profile: ProfileOpt = None,
) -> None:
    """Generate a continuation of PROMPT with speculative decoding."""
    from specdec import Generator

    tuned = with_profile(ctx, profile, target)
    target, draft = tuned.target or target, tuned.draft or draft
    temperature = temperature if tuned.temperature is None else tuned.temperature
    config = GenerationConfig(
        k=tuned.k or k,
        k_policy=tuned.k_policy or k_policy,
        branches=tuned.branches or branches,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=bias_pairs(logit_bias or ()),
        ),
        stop=tuple(stop or ()),
        seed=seed,
        logprobs=logprobs,
        grammar=grammar_of(json_schema, grammar),
        guards=guard_config(repetition_guard, temperature_schedule, anchor_every, drift_threshold, drift_anchor),
        typical_acceptance=TypicalAcceptance() if typical_acceptance else None,
    )
    if typical_acceptance:
        err.print("typical acceptance is LOSSY: the output is not exactly the target's own", style="yellow")
    if not prompt.strip():
        raise SpecDecError("the prompt is empty: pass some text to continue")
    runtime = tuned.runtime or runtime_config(backend, dtype, threads, ubatch, precision, native_format)
    with status(f"loading {target}" + (f" and {draft}" if draft != "none" else "")):
        generator = Generator(target, draft, config, runtime)
    announce_runtime(generator.target)
    _show(generator, prompt, stream, as_json)


def _show(generator: Generator, prompt: str, stream: bool, as_json: bool) -> None:
    """Generate and print: the text as it is accepted, the whole text and a line of figures, or one JSON object."""
    if stream and not as_json:
        run = generator.stream(prompt)
        for piece in run:
            print(piece, end="", flush=True)
        print()
        return
    result = generator.generate(prompt)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    print(result.text)
    s = result.stats
    err.print(
        f"{s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.1f} tok/s), {s.target_forwards} target forwards, "
        f"acceptance {s.acceptance_rate:.0%}, finish: {result.finish_reason}",
        style="dim",
    )
    for event in s.events:
        err.print(f"guard event: {event}", style="dim")


DEMO_PROMPT = (
    "def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n        for j in range(n - i - 1):\n"
    "            if items[j] > items[j + 1]:\n                items[j], items[j + 1] = items[j + 1], items[j]\n"
    "    return items\n\n\n# The same function with type hints and a docstring:\ndef bubble_sort("
)


@user_errors
def demo(
    target: Target = DEFAULT_TARGET,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate in each run.")] = default(
        GenerationConfig, "max_new_tokens"
    ),
    k: Annotated[int, typer.Option(help="Draft tokens per step.")] = default(GenerationConfig, "k"),
    backend: FastRuntimeOpt = FAST_BACKEND,
    native_format: NativeFormatOpt = default(RuntimeConfig, "native_format"),
) -> None:
    """Generate once without and once with speculation (the default drafter) and print the speed-up."""
    from specdec import Generator
    from specdec.models import open_target

    with status(f"loading {target} (the first run converts the GGUF file once, about a minute)"):
        model = open_target(target, RuntimeConfig(backend=backend, native_format=native_format))
    announce_runtime(model)
    config = GenerationConfig(k=k, max_new_tokens=max_new_tokens)
    baseline = Generator(model, "none", config)
    drafted = Generator(baseline.target, DEFAULT_DRAFT, config)
    runs = {}
    for generator in (baseline, drafted):
        with status(f"generating with draft={generator.draft_name}"):
            generator.generate(DEMO_PROMPT, max_new_tokens=4)  # warm-up
            runs[generator.draft_name] = generator.generate(DEMO_PROMPT)
    base, spec_run = runs["none"], runs[drafted.draft_name]
    err.print(Text.assemble(("prompt", "bold"), f" ({target}):\n{DEMO_PROMPT}"))
    err.print(Text.assemble(("output", "bold"), f":\n{spec_run.text}\n"))
    table = Table("draft", "tokens", "tok/s", "target forwards", "acceptance")
    for spec, r in runs.items():
        s = r.stats
        table.add_row(
            spec, str(s.new_tokens), f"{s.tokens_per_s:.1f}", str(s.target_forwards), f"{s.acceptance_rate:.0%}"
        )
    console.print(table)
    same = "identical" if base.token_ids == spec_run.token_ids else "DIFFERENT"
    speedup = spec_run.stats.tokens_per_s / base.stats.tokens_per_s
    console.print(Text.assemble("speed-up: ", (f"{speedup:.2f}x", "bold"), f"; output {same} to target-only greedy"))


def bias_pairs(given: list[str] | tuple[str, ...]) -> tuple[tuple[int, float], ...]:
    """``--logit-bias`` values (TOKEN_ID=BIAS) as pairs; a malformed one is a ConfigError naming it."""
    pairs = []
    for item in given:
        token, _, bias = item.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise ConfigError(f"--logit-bias takes TOKEN_ID=BIAS (for example 198=-100), got '{item}'") from None
    return tuple(pairs)


def grammar_of(json_schema: Path | None, gbnf: Path | None) -> Grammar | None:
    """The grammar ``--json-schema`` or ``--grammar`` names (one of them at most), read from its file."""
    if json_schema is not None and gbnf is not None:
        raise ConfigError("--json-schema and --grammar exclude each other: give one")
    path, kind = (json_schema, "json_schema") if json_schema is not None else (gbnf, "gbnf")
    if path is None:
        return None
    try:
        return Grammar(kind, path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def guard_config(
    repetition: bool,
    temperature_schedule: str | None,
    anchor_every: int | None,
    drift_threshold: float | None,
    drift_anchor: bool,
) -> GuardConfig:
    """The guards the generate options ask for."""
    return GuardConfig(
        repetition=repetition,
        temperature_schedule=float_pair("--temperature-schedule", temperature_schedule),
        anchor_every=anchor_every,
        drift_threshold=drift_threshold,
        drift_anchor=drift_anchor,
    )
