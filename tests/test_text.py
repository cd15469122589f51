from specdec.text import TextStream


class CharTokenizer:
    """ids are code points; decode joins them."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def ids(s):
    return [ord(c) for c in s]


def test_stop_string_cuts_text_and_tokens():
    ts = TextStream(CharTokenizer(), stop=["END"])
    assert ts.add(ids("hello E")) == ("hello ", ids("hello E"))  # "E" held back
    delta, kept = ts.add(ids("NDxyz"))
    assert delta == "" and kept == ids("ND") and ts.stopped
    assert ts.emitted == "hello "


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    ts = TextStream(CharTokenizer(), stop=["END"])
    assert ts.add(ids("ab EN"))[0] == "ab "
    assert ts.add(ids("x"))[0] == "ENx"
    assert ts.add(ids("E"))[0] == ""
    assert ts.finish() == "E"
    assert ts.emitted == "ab ENxE"


def test_without_stop_strings_everything_streams():
    ts = TextStream(CharTokenizer())
    assert ts.add(ids("abc"))[0] == "abc"
    assert ts.finish() == ""


def test_a_stop_string_cannot_end_the_text_before_min_tokens():
    """As vLLM: a stop string ends the output only if it ends in token min_tokens or later."""
    ts = TextStream(CharTokenizer(), stop=["ab"], min_tokens=4)
    assert ts.add(ids("ab")) == ("ab", ids("ab"))  # it ends in token 2: text, not a stop
    delta, kept = ts.add(ids("xab"))  # "b" is token 5 (>= 4): this "ab" stops
    assert ts.stopped and kept == ids("xab") and ts.emitted == "abx"
    # A stop string straddling token min_tokens counts: it ends in token 4.
    ts = TextStream(CharTokenizer(), stop=["cd"], min_tokens=4)
    ts.add(ids("xxcd"))
    assert ts.stopped and ts.emitted == "xx"
    # min_tokens = 0 or 1: every stop string counts from the first token.
    ts = TextStream(CharTokenizer(), stop=["a"], min_tokens=1)
    ts.add(ids("a"))
    assert ts.stopped and ts.emitted == ""


# --- a fast tokenizer: incremental detokenization ------------------------------------------------


class ReDecoding:
    """The same tokenizer seen without its ``tokenizers`` backend: TextStream re-decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tokenizer, ids, rounds, stop=(), min_tokens=0):
    ts = TextStream(tokenizer, stop=list(stop), min_tokens=min_tokens)
    deltas, at = [], 0
    for r in rounds:
        if ts.stopped or at >= len(ids):
            break
        delta, _ = ts.add(ids[at: at + r])
        deltas.append(delta)
        at += r
    deltas.append(ts.finish())
    return deltas, ts


def test_incremental_text_equals_decoding_the_whole_output():
    """Byte-level BPE splits multi-byte characters across tokens: the incremental stream gives
    the text a whole decode gives, never a U+FFFD in the middle, and cuts at the same stop
    string; it decodes each token once (no whole-output decode per round)."""
    import random

    from specdec.bench.tiny import build_tokenizer, synthetic_corpus

    tok = build_tokenizer(synthetic_corpus(n_sentences=50, seed=1))
    rng = random.Random(0)
    text = "héllo wörld — ünïcode ✓ 日本語のテキスト 🙂🙂 the cat sees the dog. " * 3
    ids = tok(text)["input_ids"]
    for trial in range(60):
        rounds = [rng.randint(1, 5) for _ in range(len(ids))]
        stop = [text[(a := rng.randrange(len(text) - 3)): a + rng.randint(1, 3)]] if trial % 3 else []
        counting = ReDecoding(tok)
        deltas, fast = _stream(tok, ids, rounds, stop, min_tokens=trial % 7)
        slow_deltas, slow = _stream(counting, ids, rounds, stop, min_tokens=trial % 7)
        assert "".join(deltas) == "".join(slow_deltas), (stop, trial)
        assert fast.stopped == slow.stopped
        assert not any("\ufffd" in d for d in deltas)
        if not stop:
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    counting = ReDecoding(tok)
    _stream(counting, ids, [3] * len(ids), stop=["zzz"])
    assert counting.calls >= len(ids) // 3  # the re-decoding path decodes the output every round ...
    spy = ReDecoding(tok)
    spy.backend_tokenizer = tok.backend_tokenizer  # ... the incremental one never calls decode
    _stream(spy, ids, [3] * len(ids), stop=["zzz"])
    assert spy.calls == 0
