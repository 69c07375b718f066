"""Every processor exact under speculation on the bundled real models (Gemma-3-270M, SmolLM2-135M): with penalties,
logit_bias, JSON mode, a JSON schema, a GBNF grammar or a forced tool call, greedy output with drafts is target-only's
with the same settings token for token, one sequence at a time and batched, for every kind of drafter (copying drafters
propose tokens the grammar forbids: they are cut, never accepted)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import Grammar, RuntimeConfig
from specdec.serving.protocol import ChatRequest

pytestmark = pytest.mark.real_model

GEMMA, SMOL = "gemma-3-270m", "smollm2-135m-instruct"
MAX_NEW = 24
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer"},
    },
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}
GBNF = 'root ::= "[" item (", " item)* "]"\nitem ::= [0-9]+'
NUMBER_LIST = re.compile(r"\[[0-9]+(, [0-9]+)*\]")  # GBNF's language
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
# Prompts a copying drafter finds matches in: JSON lines (copies with spaces after ':' that the compact grammar
# forbids), number lists (copies of "," without the space the grammar wants), code (repeated tokens the penalties and
# the bias push down).
PETS = [
    'Pets as JSON, one per line:\n{"name": "Rex", "kind": "dog", "age": 3}\n{"name": "Tom", "kind": "cat", "age": 5}\n'
    '{"name": "Bo", "kind": "dog", "age": 2}\n',
    'Animals seen today: {"name": "Kiwi", "kind": "bird", "age": 1} and {"name": "Tom", "kind": "cat", "age": 5}. '
    "Next one: ",
]
NUMBERS = [
    "Lists of numbers: [1,22,333], [4,55,666], [7,88,999] and then ",
    "Primes: [2, 3, 5, 7, 11, 13] and squares: [1,4,9,16,25] and cubes: ",
]
CODE = [
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n\n\ndef primes_below(limit):\n",
    "The meeting is on Tuesday at 10am in room 4B. Attendees: Ana, Bo, Chen. Agenda: budget, hiring.\n"
    "Summary: The meeting is on",
]
QUESTIONS = ["What is the weather in Rome for the next 2 days?", "What time is it in Paris? And in Rome?"]
PROCESSORS = ("penalties", "bias", "json_object", "json_schema", "gbnf", "tool")


@dataclass(frozen=True)
class Case:
    """One processor's requests: two prompts (text or token ids) under one config."""

    prompts: tuple[str | list[int], str | list[int]]
    config: GenerationConfig
    check: re.Pattern | None = None  # what a complete answer matches (the grammar's language, loosely)


@cache
def baseline(model: str, backend: str) -> Generator:
    """Target-only decoding of ``model`` on ``backend`` (auto: native where it runs the model)."""
    return Generator(model, "none", runtime=RuntimeConfig(backend))


@cache
def drafted(model: str, backend: str, spec: str) -> Generator:
    """``spec`` drafting for the baseline's own target (the same weights and runtime)."""
    alone = baseline(model, backend)
    generator = Generator(alone.target, spec, runtime=RuntimeConfig(backend))
    generator.grammars = alone.grammars  # one tokenizer table for both: building Gemma's takes seconds
    return generator


@cache
def expected(model: str, backend: str, processor: str, which: int) -> list[int]:
    """Target-only greedy tokens of one case's prompt."""
    case = cases(model, backend)[processor]
    return baseline(model, backend).generate(case.prompts[which], case.config).token_ids


@cache
def cases(model: str, backend: str) -> dict[str, Case]:
    """Each processor's case for ``model``: its prompts are encoded by its tokenizer (the bias names the tokens a copy
    of the prompt would repeat most; the tool call goes through the chat template where the model has one)."""
    alone = baseline(model, backend)
    config = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=MAX_NEW)
    frequent = Counter(alone.encode(CODE[0])).most_common(3)
    bias = SamplingConfig(logit_bias=tuple((token, -3.0) for token, _ in frequent))
    penalties = SamplingConfig(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.1)
    json_value = re.compile(r"\{.*\}", re.S)
    return {
        "penalties": Case((CODE[0], CODE[1]), replace(config, sampling=penalties)),
        "bias": Case((CODE[0], CODE[1]), replace(config, sampling=bias)),
        "json_object": Case((PETS[0], PETS[1]), replace(config, grammar=Grammar("json")), json_value),
        "json_schema": Case(
            (PETS[0], PETS[1]), replace(config, grammar=Grammar("json_schema", json.dumps(SCHEMA))), json_value
        ),
        "gbnf": Case((NUMBERS[0], NUMBERS[1]), replace(config, grammar=Grammar("gbnf", GBNF)), NUMBER_LIST),
        "tool": _tool_case(alone, config),
    }


def _tool_case(alone: Generator, config: GenerationConfig) -> Case:
    """A forced call (tool_choice required: either function) as the server makes it: the grammar of ChatRequest, the
    prompt in the chat template with the tools shown; a model without a chat template is asked in plain text."""
    prompts = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        request = ChatRequest.model_validate({"messages": messages, "tools": TOOLS, "tool_choice": "required"})
        if getattr(alone.tokenizer, "chat_template", None):
            prompts.append(alone.chat_ids(messages, request.offered))
        else:
            prompts.append(f"Functions: get_weather(city, days), get_time(city).\nUser: {question}\nCall as JSON: ")
    return Case(tuple(prompts), replace(config, grammar=request.structure()), re.compile(r'\{"name":"get_.*\}', re.S))


def _identical(model: str, backend: str, spec: str, processors: tuple[str, ...], branches: int = 1) -> int:
    """Each processor's two prompts drafted by ``spec``, one at a time and as one batch, give target-only's tokens;
    returns the draft tokens the target judged in all."""
    generator, judged = drafted(model, backend, spec), 0
    for processor in processors:
        case = cases(model, backend)[processor]
        config = replace(case.config, branches=branches)
        want = [expected(model, backend, processor, which) for which in (0, 1)]
        singles = [generator.generate(prompt, config) for prompt in case.prompts]
        batched = generator.generate_batch(list(case.prompts), config)
        for mode, results in (("single", singles), ("batched", batched)):
            got = [result.token_ids for result in results]
            assert got == want, (model, backend, spec, branches, processor, mode)
            judged += sum(result.stats.draft_tokens_proposed for result in results)
        for result in singles:
            if case.check is not None and result.finish_reason == "eos":  # a complete answer is in the grammar
                assert case.check.fullmatch(result.text.strip()), (processor, result.text)
    return judged


@pytest.mark.parametrize(
    ("model", "spec", "branches"), [(GEMMA, "lookup-then-eagle", 2), (SMOL, "prompt-lookup", 1)], ids=["gemma", "smol"]
)
def test_processors_keep_target_only_output_on_real_models(model: str, spec: str, branches: int) -> None:
    """The fast tier's check: every processor on each bundled model, Gemma with a tree of prompt-lookup and eagle
    drafts, SmolLM2 with prompt-lookup chains, on the runtime `auto` picks."""
    assert _identical(model, "auto", spec, PROCESSORS, branches) > 0
    unprocessed = replace(cases(model, "auto")["penalties"].config, sampling=SamplingConfig())
    plain = baseline(model, "auto").generate(CODE[0], unprocessed).token_ids
    assert expected(model, "auto", "penalties", 0) != plain and expected(model, "auto", "bias", 0) != plain


@pytest.fixture(scope="module")
def ngram_tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An n-gram table for each model's tokenizer, built from text like the prompts'."""
    from specdec.training.ngram import NgramBuildConfig, build_ngram_table

    folder = tmp_path_factory.mktemp("ngram")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(PETS + NUMBERS + CODE) * 3)
    tables = {}
    for model in (GEMMA, SMOL):
        alone = baseline(model, "auto")
        table = build_ngram_table(
            [str(corpus)],
            lambda texts, tokenizer=alone.tokenizer: tokenizer(texts, add_special_tokens=False)["input_ids"],
            alone.backend.vocab_size,
            NgramBuildConfig(order=4),
            {"target": model},
        )
        tables[model] = folder / f"{model}.ngram"
        table.save(tables[model])
    return tables


# (model, runtime, drafter, branches): every drafter kind the bundled models have, as chains and as trees; the draft
# models (the distilled draft, the target's own first layers) run on transformers.
MATRIX = [
    (GEMMA, "auto", "prompt-lookup", 1),
    (GEMMA, "auto", "prompt-lookup", 3),
    (GEMMA, "auto", "suffix", 1),
    (GEMMA, "auto", "ngram", 1),
    (GEMMA, "auto", "eagle", 1),
    (GEMMA, "auto", "eagle", 3),
    (GEMMA, "auto", "auto", 1),
    (GEMMA, "transformers", "prompt-lookup", 2),
    (GEMMA, "transformers", "lookup-then-draft", 1),
    (GEMMA, "transformers", "layerskip:12", 1),
    (SMOL, "auto", "prompt-lookup", 3),
    (SMOL, "auto", "suffix", 1),
    (SMOL, "auto", "suffix", 2),
    (SMOL, "auto", "ngram", 1),
    (SMOL, "auto", "auto", 1),
    (SMOL, "transformers", "prompt-lookup", 1),
    (SMOL, "transformers", "layerskip:20", 1),
    (SMOL, "transformers", "layerskip:20", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "backend", "spec", "branches"),
    MATRIX,
    ids=[f"{m.split('-')[0]}-{b}-{s}-{n}" for m, b, s, n in MATRIX],
)
def test_every_drafter_keeps_target_only_output_under_every_processor(
    model: str, backend: str, spec: str, branches: int, ngram_tables: dict[str, Path]
) -> None:
    if spec == "ngram":
        spec = f"ngram:{ngram_tables[model]}"
    assert _identical(model, backend, spec, PROCESSORS, branches) > 0
