"""Detokenization while streaming, and stop strings.

``TextStream`` turns the growing list of generated ids into text deltas. It holds back text
that could still become a stop string or that ends in an incomplete UTF-8 character, and
cuts the output at the first stop string (which is not returned, as in the OpenAI API).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextStream:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # a stop string must end after the text of the first min_tokens - 1 tokens
    ids: list[int] = field(default_factory=list)
    emitted: str = ""  # text handed out so far
    stopped: bool = False
    _floor: int | None = None  # that text's length, once known (None: no stop string may end yet)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int:
        """Index of the earliest stop string in ``text`` that ends past the floor, or -1."""
        if self._floor is None:
            return -1
        hits = [i for i in (text.find(s, max(0, self._floor - len(s) + 1)) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def _set_floor(self, ids: list[int]) -> None:
        """As vLLM: stop strings are not looked for until min_tokens tokens exist."""
        before = max(0, self.min_tokens - 1)
        if self._floor is None and len(ids) >= before:
            self._floor = len(self._decode(ids[:before])) if before else 0

    def add(self, tokens: list[int]) -> tuple[str, list[int]]:
        """Feed a round's tokens; return (text delta, the tokens kept).

        After a stop string is found ``stopped`` is set and the tokens after the one that
        completed it are dropped.
        """
        assert not self.stopped, "add() after a stop string"
        kept = list(tokens)
        if self.stop:
            self._set_floor(self.ids + kept)
        text = self._decode(self.ids + kept)
        cut = self._find_stop(text)
        if cut >= 0:
            # Keep only the tokens up to the one that completed the stop string.
            for n in range(1, len(tokens) + 1):
                if self._find_stop(self._decode(self.ids + tokens[:n])) >= 0:
                    kept = tokens[:n]
                    break
            self.stopped = True
            text = text[:cut]
        self.ids.extend(kept)
        if not self.stopped:
            text = text[: len(text) - self._held_back(text)]
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta, kept

    def finish(self) -> str:
        """The text still held back once generation ends (a partial stop string is text)."""
        if self.stopped:
            return ""
        text = self._decode(self.ids)
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta

    def _held_back(self, text: str) -> int:
        """How many trailing characters must wait: a stop string's prefix or a partial char."""
        hold = 0
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
