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
