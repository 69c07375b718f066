"""OpenAI's request and response shapes for completions and chat completions, and their errors.

Requests are validated here so that a bad field gets a 400 naming it, in the
shape OpenAI clients parse ({"error": {"message", "type", "param", "code"}}).
Fields OpenAI defines that change what is generated and that specdec does
not implement (best_of > 1, suffix, content parts other than text) are refused
by name rather than ignored. Two specdec extensions take the library's own
settings: ``guards`` (GuardConfig's fields) and ``typical_acceptance``
(TypicalAcceptance's fields; LOSSY), each an object whose omitted fields keep the library's defaults.

Every number a client sets is bounded (and every float finite), since the engine thread that does the work is shared
by every request: the request's own limits are here, the guards' in config.GUARD_BOUNDS, max_tokens by the context.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from specdec.config import (
    MAX_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    GenerationConfig,
    Grammar,
    GuardConfig,
    SamplingConfig,
    TypicalAcceptance,
)
from specdec.engine import GenerationResult, TokenLogprob
from specdec.grammar import COMPACT
from specdec.seeds import choice_seed

RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait before retrying
EXCERPT_CHARS = 60  # an error message quotes at most this much of what the client sent
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters per stop string: each step searches the text's last this many for them
MAX_TOOLS = 128  # functions offered in one request
MAX_PROMPTS = 64  # prompts in one completions request (each is its own sequence in the batch)
MAX_TOP_K = 1 << 20  # more than any vocabulary (a top_k at or past the vocabulary's size keeps every token)


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None

    def response(self, close: bool = False) -> JSONResponse:
        """The HTTP answer; ``close`` ends the connection after it (the request's body was not read to its end)."""
        headers = (self.headers or {}) | ({"Connection": "close"} if close else {})
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


# A bug: details go to the log only.
INTERNAL_ERROR = APIError(500, "internal server error (the server's log has the details)")

# The drift monitor runs a sentence-embedding model on the decoding thread: it would stall every request of the batch.
SERVER_GUARDS = tuple(f.name for f in fields(GuardConfig) if not f.name.startswith("drift_"))


def excerpt(value: object) -> str:
    """``value`` as an error message may quote it: its repr, cut short (a client's 2 MB mistake is not echoed back)."""
    return clip(repr(value))


def clip(text: str) -> str:
    """``text`` cut to what an error message may quote."""
    return text if len(text) <= EXCERPT_CHARS else f"{text[:EXCERPT_CHARS]}... ({len(text)} characters)"


class _Strict(BaseModel):
    """Types as written: "5" is no integer, 1000.0 no seed, "yes" no boolean, NaN and Infinity (which Python's JSON
    reader takes) no number; unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaSpec(_Strict):
    """OpenAI's ``response_format.json_schema``: a named schema (``strict`` is taken; the schema is always enforced)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class OpenAIRequest(_Strict):
    """Fields shared by both endpoints (OpenAI's names and defaults)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    # not OpenAI's, but common in OpenAI-compatible servers
    top_k: Annotated[int, Field(ge=1, le=MAX_TOP_K)] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence (load tests)
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_PROMPTS)] = 1  # answers per prompt, each its own sequence and seed
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None
    # not OpenAI's, but common in OpenAI-compatible servers (vLLM's and llama-server's meanings)
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] = 1.0
    user: str | None = None
    response_format: ResponseFormat | None = None
    grammar: str | None = Field(None, description="llama-server's extension: a GBNF grammar the output must match")
    guards: dict[str, Any] | None = Field(
        None,
        description="specdec extension: long-generation guards, an object of GuardConfig's fields except the drift "
        f"monitor's ({', '.join(SERVER_GUARDS)}); omitted fields keep the library's defaults",
    )
    typical_acceptance: dict[str, float] | None = Field(
        None,
        description="specdec extension, LOSSY: typical acceptance, an object of TypicalAcceptance's fields "
        f"({', '.join(f.name for f in fields(TypicalAcceptance))}); {{}} for the defaults",
    )

    def unsupported(self) -> None:
        """Refuse OpenAI options that would change the output and that specdec does not implement."""
        stops = self.stops
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"'stop' takes up to {MAX_STOPS} strings, got {len(stops)}", param="stop")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            longest = max(len(s) for s in stops)
            raise APIError(
                400,
                f"'stop' strings must be non-empty and at most {MAX_STOP_CHARS} characters long"
                + (f", got one of {longest}" if longest > MAX_STOP_CHARS else ", got an empty one"),
                param="stop",
            )

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; a key that is not a token id written in decimal is a 400."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise APIError(
                    400, f"'logit_bias' keys are token ids written as strings, got {excerpt(key)}", param="logit_bias"
                )
            pairs.append((int(key), bias))
        return tuple(pairs)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def generation_config(self, defaults: GenerationConfig, max_tokens: int, choice: int = 0) -> GenerationConfig:
        """The library's config for answer ``choice`` of this request (each answer its own seed, the first the
        request's); a bad sampling, guard or acceptance setting raises ConfigError."""
        sampling = SamplingConfig(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.bias_pairs(),
        )
        grammar = self.structure()
        # Trees do not combine with guards or typical acceptance; a grammar masks each tree node after its own path.
        plain = self.guards is None and self.typical_acceptance is None
        return GenerationConfig(
            k=defaults.k,
            k_policy=defaults.k_policy,
            branches=defaults.branches if plain else 1,
            max_new_tokens=max_tokens,
            sampling=sampling,
            stop=self.stops,
            seed=None if self.seed is None else choice_seed(self.seed, choice),
            stop_on_eos=not self.ignore_eos,
            guards=_settings(GuardConfig, self.guards, "guards", SERVER_GUARDS)
            if self.guards is not None
            else GuardConfig(),
            typical_acceptance=_settings(TypicalAcceptance, self.typical_acceptance, "typical_acceptance")
            if self.typical_acceptance is not None
            else None,
            logprobs=self.reported_alternatives,
            grammar=grammar,
        )

    def structure(self) -> Grammar | None:
        """The grammar ``response_format`` or ``grammar`` asks for (both at once is a 400)."""
        kind = self.response_format.type if self.response_format is not None else "text"
        if kind != "text" and self.grammar is not None:
            raise APIError(400, "'grammar' and a JSON response_format exclude each other: give one", param="grammar")
        if self.grammar is not None:
            return Grammar("gbnf", self.grammar)
        if kind == "json_object":
            return Grammar("json")
        if kind == "json_schema":
            spec = self.response_format.json_schema  # type: ignore[union-attr]
            if spec is None:
                raise APIError(
                    400, "'response_format' json_schema needs its json_schema object", param="response_format"
                )
            return Grammar("json_schema", json.dumps(spec.schema_))
        return None

    @property
    def reported_alternatives(self) -> int | None:
        """How many likeliest alternatives each new token's log-probability comes with; None: no log-probabilities."""
        return None


@functools.cache
def _adapter(kind: type) -> TypeAdapter:
    """A validator for a config dataclass, built once (building one reads its whole schema)."""
    return TypeAdapter(kind)


def _settings(kind: type, given: dict[str, Any], param: str, allowed: tuple[str, ...] | None = None) -> Any:
    """``kind`` (a config dataclass) from a request's object, its field types checked strictly and its numbers
    finite: a bad field is a 400 naming it (a value out of its bounds: the config's own message, which names both)."""
    allowed = allowed or tuple(f.name for f in fields(kind))
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise APIError(
            400,
            f"'{param}' has no field {clip(', '.join(repr(u) for u in unknown))} here: use {', '.join(allowed)}",
            param=param,
        )
    for name, value in given.items():
        if not _finite(value):
            raise APIError(400, f"'{clip(f'{param}.{name}')}' takes finite numbers, got {excerpt(value)}", param=param)
    try:
        # JSON mode: arrays are tuples, 8.0 is no int.
        return _adapter(kind).validate_json(json.dumps(given), strict=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in (param, *error["loc"]))
        cause = error.get("ctx", {}).get("error")  # the config's own ConfigError, without pydantic's "Value error, "
        raise APIError(400, f"'{clip(where)}': {cause or error['msg']}", param=param) from None


def _finite(value: object) -> bool:
    """Whether every float in ``value`` (a JSON value, nested as deep as the JSON reader allows) is finite."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        pending += item if isinstance(item, list) else item.values() if isinstance(item, dict) else ()
    return True


class CompletionRequest(OpenAIRequest):
    # one prompt (text or token ids) or a list of them, each answered in its own choice
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 with echo: score the prompt only
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> None:
        super().unsupported()
        for name, ok in (
            ("suffix", self.suffix is None),
            ("best_of", self.best_of in (None, 1)),
        ):
            if not ok:
                raise APIError(400, f"'{name}' is not supported by this server: leave it at its default", param=name)
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400,
                "'max_tokens' 0 generates nothing: set echo to score the prompt, or max_tokens >= 1",
                param="max_tokens",
            )
        prompts = self.prompts
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"'prompt' takes 1 to {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt")
        if len(prompts) * self.n > MAX_PROMPTS:
            raise APIError(400, f"{len(prompts)} prompts x n {self.n} answers: at most {MAX_PROMPTS} in all", param="n")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (a single prompt is a list of one)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt) if self.prompt else [[]]  # type: ignore[arg-type]

    @property
    def reported_alternatives(self) -> int | None:
        return self.logprobs


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool fields: passed to the chat template as they are

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # Text, or OpenAI's content parts ({"type": "text", "text": ...}; text parts only); none on an assistant's message
    # that made tool calls (its tool_calls field)
    content: str | list[dict[str, Any]] | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as a chat template takes it: content as one string (text parts joined; "" for none)."""
        if self.content is None and self.role != "assistant":
            raise APIError(
                400,
                f"'messages.{index}.content' is missing: only an assistant's message may have none",
                param="messages",
            )
        message = self.model_dump(exclude_none=True) | {"content": self.content or ""}
        if isinstance(self.content, list):
            message["content"] = "".join(
                _text_part(part, f"messages.{index}.content.{j}") for j, part in enumerate(self.content)
            )
        return message


def _text_part(part: dict[str, Any], where: str) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
        raise APIError(
            400,
            f'\'{where}\': only text parts are supported ({{"type": "text", "text": "..."}}), got {excerpt(part)}',
            param="messages",
        )
    return part["text"]


class FunctionSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # True: a call's arguments keep ``parameters``, under every tool_choice: required or a named function constrains
    # the answer to a call, auto with a strict function to text or a call (ChatRequest.structure)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # taken; an answer makes at most one call, which OpenAI's default (true) permits: true allows several, not requires
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs logprobs: true", param="top_logprobs")
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(
                400, f"'tool_choice' names '{clip(self.tool_choice.function.name)}', not among the tools", "tool_choice"
            )
        if self.tool_choice not in (None, "none") and not names:
            raise APIError(400, "'tool_choice' needs tools", param="tool_choice")
        if self.calls_forced and (self.response_format is not None or self.grammar is not None):
            raise APIError(400, "a forced tool call and a response format exclude each other", param="tool_choice")
        formatted = self.response_format is not None and self.response_format.type != "text"
        if self.strict_auto and (formatted or self.grammar is not None):
            raise APIError(
                400,
                "a strict function under tool_choice auto holds the answer to text or a call, which a response format "
                "or grammar would contradict: drop the response format, force the call with tool_choice, or set the "
                "functions' strict false",
                param="tools",
            )

    @property
    def offered(self) -> list[dict] | None:
        """The tools the model is shown (none with tool_choice "none"), as the chat template takes them."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def calls_forced(self) -> bool:
        """The answer must be a call: tool_choice "required" or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def strict_auto(self) -> bool:
        """tool_choice auto (or unset) with a strict function offered: the answer is held to text or a call whose
        arguments keep its function's schema."""
        return self.tool_choice in (None, "auto") and any(tool.function.strict for tool in self.tools or ())

    def structure(self) -> Grammar | None:
        if self.strict_auto:
            return Grammar("lark", text_or_call(self._calls(None)))
        if not self.calls_forced:
            return super().structure()
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return Grammar("json_schema", json.dumps(self._calls(named)))

    def _calls(self, named: str | None) -> dict:
        """The JSON schema of a call (its function's name and arguments) to the function ``named``, or to any."""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools or ()
            if named in (None, tool.function.name)
        ]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def tool_call(self, text: str) -> dict | None:
        """The call ``text`` makes (a JSON object naming an offered function and its arguments, bare or inside
        <tool_call> tags), as OpenAI's tool_calls entry; None for an answer in words. text_or_call's grammar is
        written to this reading: change both together."""
        if self.offered is None:
            return None
        body = text.strip().removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        names = {tool.function.name for tool in self.tools or ()}
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
            return None
        return {
            "id": new_id("call"),
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
        }

    @property
    def reported_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# The characters str.strip() removes (str.isspace()), as inclusive code point ranges: text whose first other
# characters are "{" or "<tool_call>" is read as a call by ChatRequest.tool_call.
STRIPPED = (
    (0x09, 0x0D),
    (0x1C, 0x20),
    (0x85, 0x85),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
)


def text_or_call(call: dict) -> str:
    """A Lark grammar (llguidance's) for an answer that is either text that ChatRequest.tool_call reads as words, or a
    call that keeps the JSON schema ``call``: compact JSON, bare or in <tool_call> tags (a newline inside each tag
    allowed), after any whitespace, ending the answer (whitespace after it would change nothing, and a weak model fills
    its budget with it).

    The text lexeme excludes every text whose first characters after stripped whitespace are "{" or "<tool_call>"
    (tool_call may read such text as a call, so it must be one that keeps the schema): no text parses as a call. The
    whitespace before a tag belongs to the tag's own lexeme: llguidance's lexer looks one byte ahead, so a separate
    whitespace lexeme would have ended before the text lexeme died at the tag's ">"."""
    stripped = "".join(f"\\x{{{low:x}}}" + (f"-\\x{{{high:x}}}" if high > low else "") for low, high in STRIPPED)
    schema = call | {"x-guidance": COMPACT}
    return "\n".join(
        (
            "start: TEXT | call",
            f"TEXT: /(?s:.*)/ & ~/[{stripped}]*(\\{{|<tool_call>)(?s:.*)/",
            "call: OPEN body CLOSE | SPACE? body",
            f"body: %json {json.dumps(schema)}",
            r"SPACE: /[ \t\n\r]+/",
            r"OPEN: /[ \t\n\r]*<tool_call>\n?/",
            r"CLOSE: /\n?<\/tool_call>/",
        )
    )


FINISH = {"length": "length", "context": "length", "eos": "stop", "stop": "stop"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, generated: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def _envelope(rid: str, kind: str, model: str, choices: list[dict], usage_: dict | None = None) -> dict:
    """OpenAI's frame around choices (each with its index and logprobs): id, object kind, creation time, model (and
    usage on whole responses)."""
    body = {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "logprobs": None} | choice for i, choice in enumerate(choices)],
    }
    return body if usage_ is None else body | {"usage": usage_}


@dataclass(frozen=True)
class Answer:
    """One prompt's answer as a completions choice reports it: its text (the prompt's first where echoed), how it
    ended, and the log-probabilities of its tokens (the prompt's first where echoed; None: not asked for)."""

    text: str
    finish: str
    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None
    offset: int  # where the text's first token starts in the prompt and completion's text


def completion_body(rid: str, model: str, answers: list[Answer], spell: Callable[[int], str], usage_: dict) -> dict:
    choices = [
        {"text": a.text, "finish_reason": a.finish}
        | ({} if a.logprobs is None else {"logprobs": completion_logprobs(a.tokens, a.logprobs, spell, a.offset)})
        for a in answers
    ]
    return _envelope(rid, "text_completion", model, choices, usage_)


def completion_logprobs(
    tokens: list[int], entries: list[TokenLogprob | None], spell: Callable[[int], str], offset: int
) -> dict:
    """The completions API's logprobs object: each token's text, log-probability (None for a prompt's first),
    alternatives by text, and where its text starts."""
    texts = [spell(token) for token in tokens]
    starts = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {spell(t): p for t, p in e.top} for e in entries],
        "text_offset": starts,
    }


def completion_chunk(
    rid: str, model: str, text: str, finish: str | None = None, index: int = 0, logprobs: dict | None = None
) -> dict:
    """A completions stream's chunk for choice ``index``."""
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    return _envelope(rid, "text_completion", model, [choice])


def chat_body(
    rid: str,
    model: str,
    results: list[GenerationResult],
    prompt_tokens: int,
    spell: Callable[[int], str],
    call: Callable[[str], dict | None] = lambda text: None,
) -> dict:
    """A chat completion with a choice per result (n of them), the prompt counted once; an answer that ``call`` reads
    as a tool call is reported as one."""
    choices = []
    for result in results:
        made = call(result.text)
        message = {"role": "assistant", "content": result.text}
        if made is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [made]}
        choice = {"message": message, "finish_reason": "tool_calls" if made else FINISH[result.finish_reason]}
        if result.logprobs is not None:
            choice["logprobs"] = chat_logprobs(result.logprobs, spell)
        choices.append(choice)
    generated = sum(len(result.token_ids) for result in results)
    return _envelope(rid, "chat.completion", model, choices, usage(prompt_tokens, generated))


def chat_logprobs(entries: list[TokenLogprob], spell: Callable[[int], str]) -> dict:
    """The chat API's logprobs object: each token's text, log-probability, bytes and alternatives."""
    return {"content": [_chat_entry(e, spell) for e in entries]}


def _chat_entry(entry: TokenLogprob, spell: Callable[[int], str]) -> dict:
    def described(token: int, logprob: float) -> dict:
        text = spell(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    return described(entry.token, entry.logprob) | {"top_logprobs": [described(t, p) for t, p in entry.top]}


def chat_chunk(
    rid: str, model: str, delta: dict, finish: str | None = None, index: int = 0, logprobs: dict | None = None
) -> dict:
    """A chat stream's chunk for choice ``index``."""
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return _envelope(rid, "chat.completion.chunk", model, [choice])


def usage_chunk(rid: str, kind: str, model: str, usage_: dict) -> dict:
    """A stream's last chunk where stream_options asks for usage: no choices, the whole request's usage."""
    return _envelope(rid, kind, model, [], usage_)


DONE = "data: [DONE]\n\n"  # a stream's last event


def sse(data: dict) -> str:
    """One server-sent event carrying ``data``."""
    return f"data: {json.dumps(data)}\n\n"


def stream_error(error: APIError) -> str:
    """How a stream whose 200 is already sent ends on an error: the error object as an event, then [DONE]."""
    return sse(error.body()) + DONE
