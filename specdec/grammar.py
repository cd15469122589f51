"""Structured output: a grammar masks the target's distribution at every scored position.

A request may carry a ``GrammarSpec`` (a JSON schema, any JSON object, a regular expression, a
choice of strings, or an EBNF grammar), compiled by xgrammar. At each position a round scores,
the grammar's state is the one after the request's output so far plus the drafts before that
position; tokens the grammar does not allow there get probability 0 in ``p`` (their logits
-inf, before any other processing). That is a change of ``p`` itself, made before
verification, so speculation stays exact for the constrained ``p``: greedy output is what plain
constrained decoding gives, token for token, and sampled output has its distribution. The
matcher advances along the emitted tokens only (accepted drafts + the last token); a draft the
grammar rejects is rejected by verification, since ``p`` gives it 0.

Each process that verifies or drafts keeps its matchers in one ``Tracker`` by sequence key,
each synced to the output it was last given: a restarted worker, a preempted request or a
draft side that has not seen a round rebuilds the state from the output it is sent. Drafters
mask their own logits with forks of the same states, so their drafts stay inside the grammar.

xgrammar's masks cost ~0.015 ms per position to compute on a 2-core AMD EPYC (49,152-token
vocabulary), well under a decode step's ~23 ms.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from specdec import trees
from specdec.grammar_spec import KINDS, GrammarSpec  # noqa: F401 (re-exported)

MAX_WHITESPACE = 2  # JSON: at most this many whitespace characters in a row (a free run never ends)
_LOOSE_CHAR, _JSON_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'


class Grammars:
    """One tokenizer's compiler (it caches what it compiled) and its masks."""

    def __init__(self, tokenizer, stop_ids: Sequence[int]):
        vocab = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        stop = sorted(set(stop_ids))
        hf = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
        # Added tokens (chat markers, ...) are control tokens, never text inside a JSON string:
        # an empty encoding makes xgrammar treat them as special and never allow them.
        special = set(getattr(tokenizer, "get_added_vocab", dict)().values()) - set(stop)
        encoded = [""] * vocab
        for text, i in tokenizer.get_vocab().items():
            encoded[i] = "" if i in special else text
        info = xgr.TokenizerInfo(encoded, hf.vocab_type, vocab_size=vocab, stop_token_ids=stop,
                                 add_prefix_space=hf.add_prefix_space)
        self.vocab = vocab
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._shift = torch.arange(32, dtype=torch.int32)
        self.seconds = 0.0  # spent making matchers and masks since the start (the bench reads it)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar (cached by the compiler); ValueError for a source it cannot read."""
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
                ebnf = str(xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE))
                # xgrammar 0.2.9 lets a length-bounded string hold raw control characters, which
                # JSON forbids (json.loads refuses them): the class its plain strings use instead.
                return self.compiler.compile_grammar(ebnf.replace(_LOOSE_CHAR, _JSON_CHAR))
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                choices = json.loads(spec.source)
                ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
                return self.compiler.compile_grammar(ebnf)
            return self.compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).splitlines()[0]  # xgrammar's time and source line
            raise ValueError(f"the {spec.kind.replace('_', ' ')} could not be compiled: {why}") from None

    def matcher(self, spec: GrammarSpec, output: Sequence[int]) -> xgr.GrammarMatcher:
        """A matcher that has consumed ``output`` (tokens the grammar does not allow end it)."""
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(self.compile(spec))
        for token in output:
            if m.is_terminated() or not m.accept_token(int(token)):
                break  # past the end (ignore_eos) nothing is constrained
        self.seconds += time.perf_counter() - t0
        return m

    def unpack(self, bitmask: torch.Tensor, width: int) -> torch.Tensor:
        """bool [n, width]: the tokens an int32 bitmask [n, ceil(vocab / 32)] allows (ids past
        the tokenizer's vocabulary never)."""
        allowed = ((bitmask.unsqueeze(-1) >> self._shift) & 1).bool().view(bitmask.shape[0], -1)[:, : self.vocab]
        if width > allowed.shape[1]:
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        return allowed[:, :width]

    def next_allowed(self, m: xgr.GrammarMatcher, width: int) -> torch.Tensor:
        """bool [width]: what ``m`` allows next (everything once it has ended)."""
        if m.is_terminated():
            return torch.ones(width, dtype=torch.bool)
        t0 = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab)
        m.fill_next_token_bitmask(bitmask)
        allowed = self.unpack(bitmask, width)[0]
        self.seconds += time.perf_counter() - t0
        return allowed

    def after(self, m: xgr.GrammarMatcher, path: Sequence[int], width: int) -> torch.Tensor:
        """bool [width]: what the grammar allows after ``m``'s state and ``path``; ``m`` is unchanged."""
        if not path:
            return self.next_allowed(m, width)
        fork = m.fork()
        for token in path:
            if fork.is_terminated():
                break
            if not fork.accept_token(int(token)):
                return torch.zeros(width, dtype=torch.bool)
        return self.next_allowed(fork, width)

    def tree_allowed(self, m: xgr.GrammarMatcher, drafts: Sequence[int], parents: Sequence[int] | None,
                     width: int) -> torch.Tensor:
        """bool [1 + N, width]: what the grammar allows after ``m``'s state (row 0) and after each
        draft node's path (row 1 + i), a chain when ``parents`` is None; ``m`` is unchanged.
        Rows after a token the grammar rejects are never reached by verification."""
        n = len(drafts)
        if m.is_terminated():
            return torch.ones(n + 1, width, dtype=torch.bool)
        parents = tuple(range(-1, n - 1)) if parents is None else tuple(parents)
        first, sibling = [-1] * (n + 1), [-1] * (n + 1)  # node 0: the root; node 1 + i: draft i
        last_child: dict[int, int] = {}
        for i, p in enumerate(parents):
            node, parent = i + 1, (0 if p == trees.ROOT else p + 1)
            if parent in last_child:
                sibling[last_child[parent]] = node
            else:
                first[parent] = node
            last_child[parent] = node
        t0 = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(n + 1, self.vocab)
        m.traverse_draft_tree(torch.tensor(first, dtype=torch.int64), torch.tensor(sibling, dtype=torch.int64),
                              torch.tensor([0, *drafts], dtype=torch.int64), bitmask)
        allowed = self.unpack(bitmask, width)
        self.seconds += time.perf_counter() - t0
        return allowed


@dataclass
class _Entry:
    spec: GrammarSpec
    matcher: xgr.GrammarMatcher
    consumed: list[int] = field(default_factory=list)


class Tracker:
    """Matchers by sequence key, each synced to the output it was given last."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._by_key: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def state(self, key: str, spec: GrammarSpec, output: Sequence[int]) -> xgr.GrammarMatcher:
        """``key``'s matcher after ``output``: advanced if it is behind, rebuilt if it differs."""
        output = list(output)
        with self._lock:
            entry = self._by_key.get(key)
            if entry is not None and entry.spec == spec and output[: len(entry.consumed)] == entry.consumed:
                for token in output[len(entry.consumed):]:
                    if entry.matcher.is_terminated() or not entry.matcher.accept_token(int(token)):
                        break
                entry.consumed = output
                return entry.matcher
            self._by_key[key] = _Entry(spec, self.grammars.matcher(spec, output), output)
            return self._by_key[key].matcher

    def release(self, key: str) -> None:
        with self._lock:
            self._by_key.pop(key, None)

    def __len__(self) -> int:
        return len(self._by_key)


_SHARED: dict[str, object] = {}


def configure(tokenizer, stop_ids: Sequence[int]) -> None:
    """The process's tokenizer for grammars (built on first use: a vocabulary pass)."""
    if _SHARED.get("source") == (tokenizer, tuple(stop_ids)):
        return
    _SHARED.clear()
    _SHARED["source"] = (tokenizer, tuple(stop_ids))


def tracker() -> Tracker:
    """The process's tracker (``configure`` first)."""
    if "tracker" not in _SHARED:
        if "source" not in _SHARED:
            raise RuntimeError("structured output: no tokenizer configured in this process")
        tokenizer, stop = _SHARED["source"]
        _SHARED["tracker"] = Tracker(Grammars(tokenizer, stop))
    return _SHARED["tracker"]  # type: ignore[return-value]


def release(key: str) -> None:
    """Forget ``key``'s matcher, if this process has one."""
    if "tracker" in _SHARED:
        _SHARED["tracker"].release(key)  # type: ignore[union-attr]
