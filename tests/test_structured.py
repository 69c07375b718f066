"""Structured output (JSON, JSON schemas, regex, GBNF): the grammar's mask is part of the target's distribution at
every verified position, so greedy output equals target-only's and sampled output follows the masked law (a mask
that ignores the drafts fails). Deterministic drafts the grammar
forbids are cut before scoring; drawn ones are judged and rejected (cutting them by their value would skip the
residual draw and change the law)."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Literal

import pytest
import torch
from conftest import loaded, perturbed, tiny_llama
from test_distribution import MIN_PVALUE, _check
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from typer.testing import CliRunner

import specdec.grammar as grammar_module
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.bench.lossless import TargetLaw
from specdec.cli.main import app
from specdec.config import Grammar, RuntimeConfig
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.errors import ConfigError
from specdec.grammar import GrammarCompiler
from specdec.models import TransformersBackend
from specdec.models.loading import materialize, resolve
from specdec.serving.protocol import STRIPPED, ChatRequest
from specdec.verification import to_probs
from specdec.verification.processors import process

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "kind"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json": Grammar("json_schema", json.dumps(SCHEMA)),
    "regex": Grammar("regex", r"(yes|no), because [a-z ]{1,30}\."),
    "gbnf": Grammar("gbnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'),
}


@cache
def smol_tokenizer():
    """SmolLM2's tokenizer (the bundled model's), which llguidance reads."""
    return AutoTokenizer.from_pretrained(materialize(resolve("smollm2-135m-instruct")))


def _generators(target, tokenizer) -> dict[str, Generator]:
    draft = perturbed(target, noise=0.03, seed=1)
    return {
        "none": Generator(loaded(target, tokenizer=tokenizer), NoDrafter()),
        "lookup": Generator(loaded(target, tokenizer=tokenizer), PromptLookupDrafter()),
        "model": Generator(loaded(target, tokenizer=tokenizer), ModelDrafter(TransformersBackend(draft))),
    }


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_under_a_grammar_equals_target_only(kind: str) -> None:
    tokenizer = smol_tokenizer()
    target = tiny_llama(0, vocab=len(tokenizer))
    gens = _generators(target, tokenizer)
    prompt = '{"name": "Rex", "kind": "dog"} [1,22,333] yes, because it is. ' * 2
    config = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=40, grammar=GRAMMARS[kind])
    expected = gens["none"].generate(prompt, config)
    for name in ("lookup", "model"):
        got = gens[name].generate(prompt, config)
        assert got.token_ids == expected.token_ids, name
    trees = replace(config, branches=2)  # prompt lookup and the model draft trees, each node masked after its path
    for name in ("lookup", "model"):
        assert gens[name].generate(prompt, trees).token_ids == expected.token_ids, f"{name}, trees"
    batched = gens["model"].generate_batch([prompt, prompt[:40]], config)
    assert batched[0].token_ids == expected.token_ids
    assert batched[1].token_ids == gens["none"].generate(prompt[:40], config).token_ids
    if expected.finish_reason == "eos":  # a complete answer matches its grammar
        text = expected.text
        if kind == "json":
            value = json.loads(text)
            assert set(value) == {"name", "kind"} and value["kind"] in ("cat", "dog")


class Forbidden(Drafter):
    """Drafts the same token every step (a copier's guess the grammar may forbid)."""

    capabilities = DrafterCapabilities()
    vocab_size = None
    backend = None

    def __init__(self, token: int) -> None:
        self.token = token

    def begin(self, settings: DraftSettings) -> None:
        pass

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        return Proposal(torch.full((k,), self.token, dtype=torch.long))

    def fork(self) -> Forbidden:
        return self


def test_drafts_the_grammar_forbids_are_cut_before_scoring() -> None:
    tokenizer = smol_tokenizer()
    target = tiny_llama(0, vocab=len(tokenizer))
    letter = tokenizer.encode("Q", add_special_tokens=False)[0]  # never allowed by a digits-only grammar
    config = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=12, grammar=Grammar("regex", "[0-9]{5,9}"))
    got = Generator(loaded(target, tokenizer=tokenizer), Forbidden(letter)).generate("n:", config)
    assert got.stats.draft_tokens_proposed == 0 and got.text.isdigit() and 5 <= len(got.text) <= 9


def test_each_tree_node_is_masked_after_its_own_path() -> None:
    """A tree's rows: row 0 after the accepted output, row j + 1 after node j's path, as a fresh constraint advanced
    along that path masks them; a node the grammar forbids repeats its parent's row (never read), and the leading
    nodes the grammar allows are counted along their paths."""
    tokenizer = smol_tokenizer()
    compiler = GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id}))
    grammar = Grammar("gbnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+')
    tok = {c: tokenizer.encode(c, add_special_tokens=False)[0] for c in "[],12Q"}
    accepted = [tok["["], tok["1"]]
    #        node:     0         1         2         3         4         5
    drafts = torch.tensor([tok[","], tok["2"], tok["]"], tok["Q"], tok["1"], tok["2"]])
    links = torch.tensor([-1, 0, -1, 2, 3, 1])  # paths: ",", ",2", "]", "]Q" (forbidden), "]Q1", ",22"
    paths = [[0], [0, 1], [2], [2, 3], [2, 3, 4], [0, 1, 5]]
    constraint = compiler.constraint(grammar)
    constraint.advance(accepted)
    logits = torch.zeros(len(drafts) + 1, len(tokenizer))
    constraint.mask(logits, drafts, links)
    assert constraint.allowed(drafts, links) == 3  # node 3 ("Q" after "]") is the first forbidden
    for row, path in [(0, []), *((j + 1, p) for j, p in enumerate(paths))]:
        forbidden = 3 in path
        fresh = compiler.constraint(grammar)
        fresh.advance(accepted + [int(drafts[i]) for i in (paths[2] if forbidden else path)])
        expected = torch.zeros(1, len(tokenizer))
        fresh.mask(expected, drafts[:0], links[:0])
        assert torch.equal(logits[row], expected[0]), (row, path)
    # the constraint is back after the accepted output
    assert constraint.allowed(drafts[:1], links[:1]) == 1 and constraint.allowed(drafts[3:4], links[:1]) == 0


def test_bad_grammars_are_refused_by_name() -> None:
    tokenizer = smol_tokenizer()
    compiler = GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id}))
    for grammar, named in [
        (Grammar("json_schema", '{"type": "objectx"}'), "does not compile"),
        (Grammar("json_schema", "{not json"), "not JSON"),
        (Grammar("gbnf", "root ::= missing"), "does not compile"),
    ]:
        with pytest.raises(ConfigError, match=named):
            compiler.constraint(grammar)
    with pytest.raises(ConfigError, match="unknown grammar kind"):
        Grammar("xml", "<a/>")


# A vocabulary of 8 one-character tokens, so that the law test's cells fill: after the prompt the grammar wants a
# letter, then a digit or a brace, and so on (at least 3 pairs: no end-of-sequence within the 5 tokens drawn).
CHARS = ["{", "}", "<eos>", "a", "b", ":", "1", "2"]  # end-of-sequence where the tiny model's config has it
PAIRS = Grammar("regex", r"([ab:][12{}]){3,}")
PROMPT = [3, 6, 4]
SAMPLED = SamplingConfig(temperature=1.0, top_p=0.98, frequency_penalty=0.6)


def _char_tokenizer() -> PreTrainedTokenizerFast:
    model = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[], unk_token=None))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>")


class MaskedLaw(TargetLaw):
    """The target's law after the prompt and a prefix: penalties from that context, then the grammar's mask after the
    prefix (the output alone: the prompt is not the grammar's)."""

    def __init__(self, model, prompt, sampling, compiler: GrammarCompiler) -> None:
        super().__init__(model, prompt, sampling)
        self.compiler = compiler

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.prompt + list(prefix)])).logits[0, -1:].float()
            none = torch.zeros(0, dtype=torch.long)
            process(logits, torch.tensor(self.prompt + list(prefix)), len(self.prompt), none, none, self.sampling)
            constraint = self.compiler.constraint(PAIRS)
            constraint.advance(list(prefix))
            constraint.mask(logits, none, none)
            self._cache[prefix] = to_probs(logits[0], self.sampling).double()
        return self._cache[prefix]


def _masked_law_pvalue(branches: int = 1) -> float:
    tokenizer = _char_tokenizer()
    target = tiny_llama(3, vocab=len(CHARS), scale=0.15)
    gen = Generator(loaded(target, tokenizer=tokenizer), ModelDrafter(TransformersBackend(perturbed(target, 0.4, 1))))
    config = GenerationConfig(
        k=4, k_policy="fixed", max_new_tokens=5, sampling=SAMPLED, grammar=PAIRS, branches=branches
    )
    results = [gen.generate(PROMPT, config, seed=seed) for seed in range(3000)]
    samples, stats = [tuple(r.token_ids) for r in results], [r.stats for r in results]
    assert {len(s) for s in samples} == {5}, "an end-of-sequence outside the shaped target's support"
    law = MaskedLaw(target, PROMPT, SAMPLED, GrammarCompiler(tokenizer, frozenset({2})))
    return _check(samples, stats, law, ("rejected at 1st", "rejected at 2nd"))


@pytest.mark.slow  # about 40 s: the fast tier keeps greedy identity under the same grammars
def test_sampled_output_under_a_grammar_follows_the_masked_law() -> None:
    assert _masked_law_pvalue() > MIN_PVALUE


@pytest.mark.slow
def test_sampled_trees_under_a_grammar_follow_the_masked_law() -> None:
    assert _masked_law_pvalue(branches=2) > MIN_PVALUE


@pytest.mark.slow
def test_a_mask_that_ignores_the_drafts_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: every position masked as the first (the drafts before it not consumed) breaks the law."""
    real = grammar_module.Constraint.mask
    monkeypatch.setattr(
        grammar_module.Constraint, "mask", lambda self, logits, drafts, links: real(self, logits, drafts[:0], links[:0])
    )
    # what the wrong masks let through is kept as it comes (the real constraint would refuse it outright)
    monkeypatch.setattr(
        grammar_module.Constraint, "advance", lambda self, tokens: [self.matcher.consume_token(t) for t in tokens]
    )
    try:
        pvalue = _masked_law_pvalue()
    except AssertionError as caught:  # a token the grammar forbids there: caught outright
        assert "outside the shaped target's support" in str(caught)
        return
    assert pvalue < MIN_PVALUE


@pytest.fixture(scope="module")
def smol_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny model with SmolLM2's tokenizer and chat template."""
    folder = tmp_path_factory.mktemp("structured") / "tiny-smol"
    tokenizer = smol_tokenizer()
    tiny_llama(0, vocab=len(tokenizer), hidden=64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_cli_takes_a_schema_and_reports_logprobs(smol_folder: Path, tmp_path: Path) -> None:
    schema = tmp_path / "pet.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}},
                "required": ["kind"],
                "additionalProperties": False,
            }
        )
    )
    args = ["generate", "A pet:", "--target", str(smol_folder), "--draft", "prompt-lookup", "--max-new-tokens", "20"]
    got = CliRunner().invoke(app, [*args, "--json-schema", str(schema), "--logprobs", "2", "--json"])
    assert got.exit_code == 0, got.output
    result = json.loads(got.output.strip().splitlines()[-1])
    assert json.loads(result["text"])["kind"] in ("cat", "dog")
    assert len(result["logprobs"]) == len(result["token_ids"])
    # two alternatives where the grammar allows two or more, else the one it allows (never one of probability 0)
    assert all(1 <= len(e["top"]) <= 2 and all(math.isfinite(p) for _, p in e["top"]) for e in result["logprobs"])
    missing = CliRunner().invoke(app, [*args, "--grammar", str(tmp_path / "none.gbnf")])
    assert missing.exit_code != 0 and "cannot read" in missing.output and "Traceback" not in missing.output


@pytest.fixture(scope="module")
def served(smol_folder: Path):
    """`specdec serve` on the tiny SmolLM2-tokenizer model, drafting by prompt lookup in trees of up to 3 branches
    (a grammar masks each node after its own path); and the same model and drafter in this process, drafting chains
    (greedy output is the target's either way)."""
    from test_serve import Server

    folder = smol_folder
    fixed = ("--k", "4", "--k-policy", "fixed", "--k-cap", "fixed")
    server = Server(str(folder), "--draft", "prompt-lookup", *fixed, "--branches", "3")
    local = Generator(str(folder), "prompt-lookup", GenerationConfig(k=4, k_policy="fixed"), RuntimeConfig("auto"))
    yield server, local
    server.stop()


def test_structured_output_through_the_openai_client(served) -> None:
    """A Pydantic model's schema (the client's structured-output parse), JSON mode and llama-server's GBNF grammar:
    each answer is what the library gives with the same grammar, and a schema that does not compile is a 400 naming
    response_format."""
    import openai
    from pydantic import BaseModel

    server, local = served

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        legs: Literal[2, 4]

    messages = [{"role": "user", "content": "A pet, as JSON:"}]
    parsed = server.client.beta.chat.completions.parse(
        model=server.client.models.list().data[0].id,
        messages=messages,
        response_format=Pet,
        max_tokens=40,
        temperature=0,
    )
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet)
    # the client sends the model's schema made strict: every property required, no others
    schema = Grammar("json_schema", json.dumps(Pet.model_json_schema() | {"additionalProperties": False}))
    ids = local.chat_ids(messages)
    assert parsed.choices[0].message.content == local.generate(ids, max_new_tokens=40, grammar=schema).text

    prompt = "Numbers: [4,5,6] and [7,8]. More: "
    gbnf = 'root ::= "[" [0-9] ("," [0-9])* "]"'
    got = server.client.completions.create(
        model=None, prompt=prompt, max_tokens=20, temperature=0, extra_body={"grammar": gbnf}
    )
    assert got.choices[0].text == local.generate(prompt, max_new_tokens=20, grammar=Grammar("gbnf", gbnf)).text
    json_mode = server.client.completions.create(
        model=None, prompt=prompt, max_tokens=30, temperature=0, extra_body={"response_format": {"type": "json_object"}}
    )
    expected = local.generate(prompt, max_new_tokens=30, grammar=Grammar("json"))
    assert json_mode.choices[0].text == expected.text
    if expected.finish_reason == "eos":
        assert isinstance(json.loads(expected.text), dict)
    # logprobs under a grammar: where it allows fewer tokens than asked for, only those are listed (never -inf,
    # which JSON cannot carry), whole and streamed
    scored = server.client.completions.create(
        model=None, prompt=prompt, max_tokens=8, temperature=0, logprobs=5, extra_body={"grammar": gbnf}
    )
    assert scored.choices[0].text == got.choices[0].text[: len(scored.choices[0].text)]
    tops = scored.choices[0].logprobs.top_logprobs
    assert any(len(top) < 5 for top in tops) and all(math.isfinite(v) for top in tops for v in top.values())
    stream = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}},
    )
    entries = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert entries and any(len(entry.top_logprobs) < 5 for entry in entries)
    assert all(math.isfinite(alt.logprob) for entry in entries for alt in entry.top_logprobs)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.completions.create(model=None, prompt="hi", max_tokens=4, extra_body={"response_format": bad})
    assert refused.value.body["param"] == "response_format" and "does not compile" in refused.value.body["message"]


def test_tool_calls_round_trip_through_the_openai_client(served) -> None:
    """A forced call (tool_choice required, or a named function) is constrained to the function's JSON and answered
    as OpenAI's tool_calls; the call and its result go back as messages; an unknown function is a 400."""
    import openai

    server, local = served
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        },
        {
            "type": "function",
            "function": {"name": "noop", "parameters": {"type": "object", "additionalProperties": False}},
        },
    ]
    messages = [{"role": "user", "content": "Weather in Rome for 2 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        got = server.client.chat.completions.create(
            model=None, messages=messages, tools=tools, tool_choice=choice, max_tokens=40, temperature=0
        )
        answer = got.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.type == "function" and call.id.startswith("call-")
        if choice is named or call.function.name == "get_weather":
            assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
        else:
            assert call.function.name == "noop" and arguments == {}
        # streamed, the same call in one delta, as OpenAI's stream accumulators read it
        chunks = list(
            server.client.chat.completions.create(
                model=None,
                messages=messages,
                tools=tools,
                tool_choice=choice,
                max_tokens=40,
                temperature=0,
                stream=True,
            )
        )
        (delta,) = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
        assert delta[0].index == 0 and delta[0].function.model_dump() == call.function.model_dump()
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    followed = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 24 C"},
    ]
    after = server.client.chat.completions.create(
        model=None, messages=followed, tools=tools, max_tokens=8, temperature=0
    )
    assert after.choices[0].message.tool_calls is None or after.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.chat.completions.create(
            model=None, messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "fly"}}
        )
    assert refused.value.body["param"] == "tool_choice"


def _strict_payload(**fields) -> dict:
    """A chat request's fields offering get_weather as the openai client's pydantic_function_tool makes it (strict),
    and a function that is not strict."""
    import openai
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Rome"]
        days: Literal[1, 2, 3]

    tools = [
        openai.pydantic_function_tool(Weather, name="get_weather", description="The weather in a city"),
        {
            "type": "function",
            "function": {"name": "noop", "parameters": {"type": "object", "additionalProperties": False}},
        },
    ]
    messages = [{"role": "user", "content": "Weather in Rome for 2 days?"}]
    return {"messages": messages, "tools": tools} | fields


def _keeps_its_schema(request: ChatRequest, call: dict) -> bool:
    """Whether ``call`` (a tool_calls entry) names an offered function and its arguments validate against its
    parameters."""
    import jsonschema

    (function,) = [t.function for t in request.tools or () if t.function.name == call["function"]["name"]]
    arguments = json.loads(call["function"]["arguments"])
    return not list(jsonschema.Draft202012Validator(function.parameters).iter_errors(arguments))


def test_strict_functions_under_auto_allow_text_or_a_call_that_keeps_its_schema() -> None:
    """With tool_choice auto and a strict function, the grammar takes text (which tool_call reads as words) or a call
    (bare or in tags) whose arguments keep its schema; text that tool_call would read as a call is no text; without a
    strict function, or with tool_choice none, nothing is constrained."""
    request = ChatRequest.model_validate(_strict_payload())
    grammar = request.structure()
    assert grammar is not None and grammar.kind == "lark"
    matcher = GrammarCompiler(smol_tokenizer(), frozenset({2})).constraint(grammar).matcher

    def allowed(text: str) -> bool:
        ids = smol_tokenizer().encode(text)
        consumed = matcher.try_consume_tokens(ids)
        complete = consumed == len(ids) and matcher.is_accepting()
        matcher.rollback(consumed)
        return complete

    texts = ["Sure, let me check.", "", "It is {sunny} in Rome", "a <tool_call>"]
    calls = [
        '{"name":"get_weather","arguments":{"city":"Rome","days":2}}',
        ' <tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":1}}\n</tool_call>',
        '\n{"name":"noop","arguments":{}}',
    ]
    broken = [
        '{"name":"get_weather","arguments":{"city":"Oslo","days":2}}',  # not in the enum
        '{"name":"get_weather","arguments":{"city":"Rome"}}',  # a required argument missing
        '<tool_call>{"name":"noop","arguments":{"x":1}}</tool_call>',  # a property the schema forbids
        '\u3000{"name":"fly","arguments":{}}',  # no such function, after a space str.strip() removes
        "{not a call",
        "<tool_call> hello",
        '{"name":"noop","arguments":{}}\n',  # the call ends the answer
    ]
    for text in texts:
        assert allowed(text) and request.tool_call(text) is None, text
    for text in calls:
        made = request.tool_call(text)
        assert allowed(text) and made is not None and _keeps_its_schema(request, made), text
    for text in broken:
        assert not allowed(text), text
    # the text lexeme's leading space is exactly what str.strip() removes
    listed = {c for low, high in STRIPPED for c in range(low, high + 1)}
    assert listed == {c for c in range(0x110000) if chr(c).isspace()}
    loose = _strict_payload()
    loose["tools"][0]["function"]["strict"] = False
    assert ChatRequest.model_validate(loose).structure() is None
    assert ChatRequest.model_validate(_strict_payload(tool_choice="none")).structure() is None


def test_strict_functions_under_auto_through_the_openai_client(served, smol_folder: Path) -> None:
    """Through the server (drafting by prompt lookup), a strict function with tool_choice auto: the answer is text,
    or a call whose arguments keep the schema (a logit_bias toward "{" makes the tiny model call), each what
    target-only decoding gives for the same request, whole and streamed; with a response format it is a 400 naming
    tools."""
    import openai

    server, _ = served
    none = Generator(str(smol_folder), "none", GenerationConfig(k=4, k_policy="fixed"), RuntimeConfig("auto"))
    opening = smol_tokenizer().convert_tokens_to_ids(["{", '{"'])
    for bias in (None, {str(token): 100 for token in opening}):
        sent = _strict_payload(max_tokens=40, temperature=0) | ({"logit_bias": bias} if bias else {})
        request = ChatRequest.model_validate(sent)
        got = server.client.chat.completions.create(model=None, **sent)
        messages = [m.for_template(i) for i, m in enumerate(request.messages)]
        expected = none.generate(none.chat_ids(messages, request.offered), request.generation_config(none.config, 40))
        made = request.tool_call(expected.text)
        answer = got.choices[0]
        if made is None:
            assert answer.message.tool_calls is None and answer.message.content == expected.text
            continue
        (call,) = answer.message.tool_calls
        assert answer.finish_reason == "tool_calls" and call.function.model_dump() == made["function"]
        assert _keeps_its_schema(request, made)
        chunks = list(server.client.chat.completions.create(model=None, stream=True, **sent))
        (delta,) = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
        assert delta[0].function.model_dump() == made["function"]
    assert bias is not None and made is not None  # the biased request made a call
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.chat.completions.create(
            model=None, max_tokens=4, response_format={"type": "json_object"}, **_strict_payload()
        )
    assert refused.value.body["param"] == "tools" and "strict" in refused.value.body["message"]


def test_grammar_requests_on_a_tree_server_equal_target_only(served, smol_folder: Path) -> None:
    """A grammar keeps the server's trees (guards still turn them off), and grammar requests answered together in
    one batch of tree rows give target-only's greedy text: GBNF, JSON mode, a JSON schema, a forced tool call."""
    from specdec.serving.protocol import ChatRequest, CompletionRequest

    server, _ = served
    defaults = GenerationConfig(branches=3)
    gbnf = 'root ::= "[" [0-9] ("," [0-9])* "]"'
    request = CompletionRequest.model_validate({"prompt": "x", "grammar": gbnf})
    assert request.generation_config(defaults, 8).branches == 3
    guarded = CompletionRequest.model_validate({"prompt": "x", "grammar": gbnf, "guards": {"repetition": True}})
    assert guarded.generation_config(defaults, 8).branches == 1

    alone = Generator(str(smol_folder), "none", GenerationConfig(k_policy="fixed"), RuntimeConfig("auto"))
    prompt = "Numbers: [4,5,6] and [7,8] and [4,5,6]. More: "
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}
    formats = [
        ({"grammar": gbnf}, Grammar("gbnf", gbnf)),
        ({"response_format": {"type": "json_object"}}, Grammar("json")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}},
            Grammar("json_schema", json.dumps(schema)),
        ),
    ]
    messages = [{"role": "user", "content": "Weather in Rome for 2 days? " * 3}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    forced = ChatRequest.model_validate({"messages": messages, "tools": tools, "tool_choice": "required"})

    def ask(i: int) -> str:
        if i < len(formats):
            body = {"model": None, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            return server.client.completions.create(**body, extra_body=formats[i][0]).choices[0].text
        called = server.client.chat.completions.create(
            model=None, messages=messages, tools=tools, tool_choice="required", max_tokens=40, temperature=0
        )
        return called.choices[0].message.tool_calls[0].function.arguments

    expected = [alone.generate(prompt, max_new_tokens=24, grammar=grammar).text for _, grammar in formats]
    call = alone.generate(alone.chat_ids(messages, forced.offered), max_new_tokens=40, grammar=forced.structure())
    expected.append(json.dumps(json.loads(call.text)["arguments"]))
    with ThreadPoolExecutor(len(expected)) as pool:
        assert list(pool.map(ask, range(len(expected)))) == expected


def test_tool_choice_none_and_auto_answer_in_words(served) -> None:
    """tool_choice "none" shows the model no tools and answers in words; "auto" (explicit, or left out) shows them and
    leaves the answer unconstrained: here text, not a call. Each is the library's greedy text for the same prompt."""
    from specdec.serving.protocol import ChatRequest

    server, local = served
    messages = [{"role": "user", "content": "Say hello."}]
    tools = [
        {
            "type": "function",
            "function": {"name": "greet", "parameters": {"type": "object", "properties": {"who": {"type": "string"}}}},
        }
    ]
    shown = ChatRequest.model_validate({"messages": messages, "tools": tools}).offered
    plain, with_tools = local.chat_ids(messages), local.chat_ids(messages, shown)
    assert plain != with_tools  # the template shows the tools
    for choice, prompt in (("none", plain), ("auto", with_tools), (None, with_tools)):
        extra = {} if choice is None else {"tool_choice": choice}
        got = server.client.chat.completions.create(
            model=None, messages=messages, tools=tools, max_tokens=12, temperature=0, **extra
        ).choices[0]
        assert got.message.tool_calls is None and got.finish_reason in ("stop", "length"), choice
        assert got.message.content == local.generate(prompt, max_new_tokens=12).text, choice
