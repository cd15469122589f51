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
    ids: list[int] = field(default_factory=list)
    emitted: str = ""  # text handed out so far
    stopped: bool = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int:
        """Index of the earliest stop string in ``text``, or -1."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def add(self, tokens: list[int]) -> tuple[str, list[int]]:
        """Feed a round's tokens; return (text delta, the tokens kept).

        After a stop string is found ``stopped`` is set and the tokens after the one that
        completed it are dropped.
        """
        assert not self.stopped, "add() after a stop string"
        kept = list(tokens)
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
