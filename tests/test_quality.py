"""``specdec quality``: every mode's greedy answers against plain decoding, with a planted fault."""

import pytest

from specdec.bench import quality
from specdec.batch import verify as batch_verify
from specdec.config import ModelConfig
from specdec.engine import Engine
from specdec.verify import Verdict

SMALL = {"factual": quality.SUITE["factual"][:3], "code": quality.SUITE["code"][:3]}


@pytest.fixture(scope="module")
def engine(llama_pair):
    e = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]),
                                dtype="float32"), max_num_seqs=8)
    yield e
    e.loop.close()


def test_first_difference_and_compare():
    assert quality.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert quality.first_difference([1, 2, 3], [1, 9, 3]) == 1
    got = quality.compare({"a": [1, 2, 3, 4], "b": [5, 6]}, {"a": [1, 2, 0, 0], "b": [5, 6]})
    assert got == {"identical": 1, "requests": 2, "token_fraction": 4 / 6, "first_difference": 2}


def test_a_correct_unit_passes_every_mode_alone_and_batched(engine):
    rows = quality.run(quality.in_process_sender(engine), ["draft", "draft_tree", "ngram", "auto"], 16, SMALL)
    assert {r["mode"] for r in rows} == {"draft", "draft_tree", "ngram", "auto", "batched"}
    assert all(r["identical"] == r["requests"] == 3 and r["token_fraction"] == 1.0 for r in rows), rows


def test_a_verifier_that_accepts_every_draft_is_caught(engine, monkeypatch):
    def accept_all(row, argmax):  # the planted fault: drafts are taken whatever the target says
        return Verdict(tokens=[*row.drafts, argmax[len(row.drafts)]], num_accepted=len(row.drafts),
                       num_drafted=len(row.drafts))

    def send(prompt, mode, max_tokens):  # a fixed k: the policy may not fall back to plain decoding
        ids = engine.encode(messages=[{"role": "user", "content": prompt}])
        return engine.generate(ids, max_tokens=max_tokens, mode=mode, k=None if mode == "off" else 4).token_ids

    monkeypatch.setattr(batch_verify, "_match", accept_all)
    rows = quality.run(send, ["draft"], 16, SMALL)
    draft = [r for r in rows if r["mode"] == "draft"]
    assert any(r["identical"] < r["requests"] for r in draft), rows
    assert all(r["first_difference"] is None or r["first_difference"] >= 0 for r in rows)
