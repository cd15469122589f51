"""Detokenization while streaming, and stop strings.

``TextStream`` turns the growing list of generated ids into text deltas. It holds back text
that could still become a stop string or that ends in an incomplete UTF-8 character, and
cuts the output at the first stop string (which is not returned, as in the OpenAI API).

With a fast (``tokenizers``) tokenizer the text grows incrementally (``DecodeStream``: each
token is decoded once, and a partial UTF-8 character waits inside the decoder), so a request's
detokenization costs O(its length), and a stop string is looked for only where the new text
could complete one. Other tokenizers re-decode the whole output each round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


@dataclass
class TextStream:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # a stop string must end after the text of the first min_tokens - 1 tokens
    ids: list[int] = field(default_factory=list)
    emitted: str = ""  # text handed out so far
    stopped: bool = False
    text: str = ""  # the text of every token added so far (kept or not: see ``add``)
    _ends: list[int] = field(default_factory=list)  # incremental: len(text) after each token
    _floor: int | None = None  # where a stop string may end, once known (None: not yet)
    _pending: list[int] = field(default_factory=list)  # the round being added

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._backend = backend if DecodeStream is not None else None
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _append(self, tokens: list[int]) -> int:
        """Decode ``tokens`` after the text so far; returns where a new stop string may start."""
        if self._stream is None:  # re-decode: earlier characters may change (a completed char)
            self.text = self._decode(self.ids + tokens)
            return 0
        start = len(self.text)
        for token in tokens:
            self.text += self._stream.step(self._backend, token) or ""
            self._ends.append(len(self.text))
        return start

    def _text_after(self, n: int) -> str:
        """The text of the first ``n`` tokens of ``ids`` + the round's tokens."""
        if self._stream is None:
            return self._decode((self.ids + self._pending)[:n])
        return self.text[: self._ends[n - 1] if n else 0]

    def _find_stop(self, text: str, start: int = 0) -> tuple[int, int]:
        """(index, end) of the earliest stop string in ``text`` that ends past the floor and past
        ``start``, or (-1, -1)."""
        if self._floor is None:
            return -1, -1
        hits = []
        for s in self.stop:
            i = text.find(s, max(0, self._floor - len(s) + 1, start - len(s) + 1))
            if i >= 0:
                hits.append((i, i + len(s)))
        return min(hits) if hits else (-1, -1)

    def _set_floor(self, n_tokens: int) -> None:
        """As vLLM: stop strings are not looked for until min_tokens tokens exist."""
        before = max(0, self.min_tokens - 1)
        if self._floor is None and n_tokens >= before:
            self._floor = len(self._text_after(before))

    def add(self, tokens: list[int]) -> tuple[str, list[int]]:
        """Feed a round's tokens; return (text delta, the tokens kept).

        After a stop string is found ``stopped`` is set and the tokens after the one that
        completed it are dropped.
        """
        assert not self.stopped, "add() after a stop string"
        self._pending = list(tokens)
        start = self._append(tokens)
        kept, text = list(tokens), self.text
        if self.stop:
            self._set_floor(len(self.ids) + len(tokens))
            cut, end = self._find_stop(self.text, start)
            if cut >= 0:
                # Keep only the tokens up to the one whose text completed the stop string.
                found = self.text[cut:end]
                n = next((n for n in range(1, len(tokens) + 1)
                          if self._text_after(len(self.ids) + n)[cut:end] == found), len(tokens))
                kept, text, self.stopped = tokens[:n], self.text[:cut], True
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
        text = self.text if self._stream is not None else self._decode(self.ids)
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta

    def _held_back(self, text: str) -> int:
        """How many trailing characters must wait: a stop string's prefix or a partial char."""
        partial = len(text) - len(text.rstrip("\ufffd"))  # an incomplete character (re-decoding)
        text = text[: len(text) - partial]  # a stop string's prefix may stand before it
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return partial + hold
