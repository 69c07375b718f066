"""Prompts in, checked token ids out: text, token ids or chat messages, refused in one line when they cannot work."""

from __future__ import annotations

import json
from functools import cached_property

from specdec.errors import ContextLengthError, PromptError
from specdec.models.target import Tokenizer


class PromptEncoder:
    """Encodes and checks prompts for one target: its tokenizer (None: token ids only), vocabulary and context."""

    def __init__(self, tokenizer: Tokenizer | None, name: str, vocab_size: int, max_context: int) -> None:
        self.tokenizer, self.name, self.vocab_size, self.max_context = tokenizer, name, vocab_size, max_context

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
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self._fits(ids, "prompt")

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat ``messages`` (OpenAI's role/content dicts, content as text) in the target's chat template, tokenized
        and checked; ``tools`` (OpenAI's function definitions) go to the template where it takes them, else into a
        system message that says how to call one (a JSON object with the function's name and arguments)."""
        tokenizer = self._tokenizer_for("chat messages")
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(f"model '{self.name}' has no chat template: send a plain prompt (a completion) instead")
        for i, message in enumerate(messages):
            for field, value in message.items():  # content, and whatever else the template reads (name, tool fields)
                self._check_text(
                    json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value,
                    f"message {i}'s {field}",
                )
        if tools and "tools" not in str(tokenizer.chat_template):
            messages = [{"role": "system", "content": tool_instructions(tools)}, *messages]
        self._check_text("".join(str(m.get("content", "")) for m in messages), "the messages together")
        try:
            ids = tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (roles, order) raises what it likes
            raise PromptError(f"the chat template rejected these messages: {str(exc)[:200]}") from None
        return self._fits(list(ids), "messages")

    def _tokenizer_for(self, what: str):
        if self.tokenizer is None:
            raise PromptError(f"model '{self.name}' has no tokenizer to encode {what}: pass token ids instead")
        return self.tokenizer

    def _check_text(self, text: str, what: str) -> None:
        """Refuse text a tokenizer would choke on (lone surrogates) or that cannot fit the context, before spending time
        tokenizing it."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(
                f"{what} is not valid Unicode: a lone surrogate ({text[exc.start]!a}) at character {exc.start}: "
                "send well-formed text"
            ) from None
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ContextLengthError(
                f"{what} has {len(text)} characters, more than model '{self.name}' can hold in its context of "
                f"{self.max_context} tokens (at most {self.max_prompt_chars}: no token is longer than "
                f"{self.max_prompt_chars // self.max_context} characters): shorten it"
            )

    @cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt can have and still fit the context: the context times the longest token's
        characters.

        None where the tokenizer does not list its vocabulary (llama.cpp's): then only the token count is checked.
        """
        vocab = getattr(self.tokenizer, "get_vocab", None)
        return None if vocab is None else self.max_context * max(map(len, vocab()))

    def _fits(self, ids: list[int], field: str) -> list[int]:
        if len(ids) >= self.max_context:
            raise ContextLengthError(
                f"the {field} has {len(ids)} tokens but model '{self.name}' has a context of "
                f"{self.max_context}: shorten the {field}"
            )
        return ids


def tool_instructions(tools: list[dict]) -> str:
    """A system message offering ``tools`` to a model whose chat template has no place for them."""
    listed = json.dumps([tool.get("function", tool) for tool in tools], ensure_ascii=False)
    return (
        f"You can call these functions: {listed}\nTo call one, answer with only a JSON object: "
        '{"name": <the function\'s name>, "arguments": <an object of its parameters>}.'
    )
