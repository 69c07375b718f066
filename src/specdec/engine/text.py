"""Incremental detokenization with stop strings, for streaming text as tokens are accepted."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextTracker:
    """Turns a growing token list into text deltas, and finds stop strings.

    A delta never ends in a partial UTF-8 character or in text that could be the
    start of a stop string, so streamed text never has to be taken back.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> list[int]:
        """Append tokens; return those kept (fewer when a stop string completes inside them)."""
        text = self._decode(self.ids + new_ids)
        cut = self._stop_index(text)
        if cut is not None:
            # Keep only the tokens up to the one that completes the stop string.
            for count in range(1, len(new_ids) + 1):
                if self._stop_index(self._decode(self.ids + new_ids[:count])) is not None:
                    new_ids = new_ids[:count]
                    break
            self.stopped = True
            text = text[:cut]
        self.ids += new_ids
        self.text = text
        return new_ids

    def _stop_index(self, text: str) -> int | None:
        hits = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        return min(hits) if hits else None

    def delta(self, final: bool = False) -> str:
        """Text not yet emitted that is safe to emit now."""
        end = len(self.text)
        if not final:
            end = len(self.text.rstrip("\ufffd"))
            for stop in self.stops:
                for size in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[end - size : end] == stop[:size]:
                        end -= size
                        break
        if end <= self.emitted:
            return ""
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece
