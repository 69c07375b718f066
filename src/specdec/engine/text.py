"""Incremental detokenization with stop strings, for streaming text as tokens are accepted."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextTracker:
    """Turns a growing token list into text deltas, and finds stop strings.

    A delta never ends in a partial UTF-8 character or in text that could be the
    start of a stop string, so streamed text never has to be taken back. Each step
    searches for stop strings only where one could have completed: from the longest
    stop's length before the new text on.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(map(len, stops), default=0)
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
        """Where the first stop string in ``text`` begins (None: none), searched where one can begin that the text so
        far did not hold: text before the point where ``text`` departs from it holds none."""
        if not self.stops:
            return None
        kept = self.text.rstrip("\ufffd")  # a partial character at its end may have completed since
        start = max(len(kept) - self.longest + 1, 0) if text.startswith(kept) else 0
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        return min(hits) if hits else None

    def delta(self, final: bool = False) -> str:
        """Text not yet emitted that is safe to emit now."""
        end = len(self.text)
        if not final:
            end = len(self.text.rstrip("\ufffd"))
            for stop in self.stops:
                end = self._before_stop_start(stop, end)
        if end <= self.emitted:
            return ""
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def _before_stop_start(self, stop: str, end: int) -> int:
        """``end``, or where the longest text ending there that begins ``stop`` (shorter than it) starts."""
        at = self.text.find(stop[0], max(end - len(stop) + 1, 0), end)
        while at >= 0:  # the earliest candidate first: the longest
            if stop.startswith(self.text[at:end]):
                return at
            at = self.text.find(stop[0], at + 1, end)
        return end
