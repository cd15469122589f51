"""EAGLE-3's training-time test and the diverse teacher prompts (tiny fp32 pairs, seconds).

Training-time test: with the same steps and seed, a head trained unrolled on its own
predictions (``ttt_steps=3``) agrees more with the target at depth 2, held out, than one
trained without (``ttt_steps=1``); training is deterministic and a checkpointed run resumes
to the same weights. Prompts: deterministic, disjoint from the held-out prompts, diverse.
"""

import pytest
import torch

from specdec.bench.tiny import synthetic_corpus
from specdec.demo.config import BuildConfig
from specdec.demo.corpus import function_snippets, split_files, stdlib_files
from specdec.demo.diverse_prompts import diverse_prompts, extract_question, self_instruct_seeds
from specdec.demo.eagle import EagleTrainConfig, eagle_agreement, init_eagle_head, train_eagle
from specdec.demo.prompts import chat_prompts, split_topics
from specdec.demo.teacher import teacher_code
from specdec.loading import load_model, load_tokenizer


def chunks(tok, seed: int, n: int, length: int = 64) -> list[list[int]]:
    ids = tok(" ".join(synthetic_corpus(n_sentences=40 * n, seed=seed)))["input_ids"]
    return [ids[i:i + length] for i in range(0, len(ids) - length, length)][:n]


@pytest.fixture(scope="module")
def data(llama_pair):
    model, tok = load_model(str(llama_pair["target"])), load_tokenizer(str(llama_pair["target"]))
    cfg = BuildConfig(topk=8)
    return model, teacher_code(model, chunks(tok, 5, 48), cfg, "teacher"), teacher_code(model, chunks(tok, 6, 8), cfg, "teacher")


def _train(model, train, ttt: int, steps: int = 120, **kw):
    tcfg = EagleTrainConfig(steps=steps, batch_tokens=2048, lr=3e-3, warmup=10, ttt_steps=ttt)
    head = init_eagle_head(model, torch.arange(model.config.vocab_size), tcfg)
    train_eagle(head, train, tcfg, **kw)
    return head


def test_training_time_test_raises_depth2_agreement_held_out(data):
    model, train, held = data
    plain, ttt = _train(model, train, 1), _train(model, train, 3)
    got = {name: [round(eagle_agreement(h, held, d), 3) for d in (1, 2, 3)] for name, h in
           (("ttt1", plain), ("ttt3", ttt))}
    assert got["ttt3"][1] > got["ttt1"][1] + 0.02, got  # depth 2: the draft the unroll trains
    assert got["ttt3"][2] > got["ttt1"][2], got  # depth 3
    assert got["ttt3"][0] > 0.5, got  # the first draft still learns


def test_ttt_training_is_deterministic_and_resumes(data, tmp_path):
    model, train, held = data
    a = _train(model, train, 3, steps=30)
    ckpt = tmp_path / "state.pt"
    b = _train(model, train, 3, steps=30, checkpoint=ckpt, every=20)  # leaves its step-20 state
    assert ckpt.is_file()
    c = _train(model, train, 3, steps=30, checkpoint=ckpt, every=20)  # resumes at step 20
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]) and torch.equal(v, c.state_dict()[k]), k


@pytest.fixture(scope="module")
def splits():
    train_files, _ = split_files(stdlib_files(), 0, 0.08)
    train, held = chat_prompts(0, 960, 16, function_snippets(train_files, 0))
    return train_files, train, held


def test_diverse_prompts_are_deterministic_disjoint_and_diverse(splits):
    train_files, train, held = splits
    a = diverse_prompts(0, 320, train_files, held + train)
    assert a == diverse_prompts(0, 320, train_files, held + train)
    assert len(a) == len(set(a)) == 320
    assert not set(a) & set(held) and not set(a) & set(train)
    held_topics = split_topics(0)[1]
    assert not [p for p in a if any(t in p for t in held_topics if len(t) > 6)]
    first = {p.split()[0] for p in a}
    assert len(first) >= 15, sorted(first)
    assert sum("`" in p for p in a) > 40  # stdlib questions
    assert sum(p.startswith("I am a ") for p in a) > 40  # multi-sentence prompts
    assert sum(p.count(".") + p.count("?") >= 2 for p in a) > 60
    seeds = self_instruct_seeds(0, 64)
    assert seeds == self_instruct_seeds(0, 64) and len(set(seeds)) == 64
    assert not [s for s in seeds if any(t in s for t in held_topics)]


def test_extract_question():
    assert extract_question('"What makes honey last so long?"<|im_end|>') == "What makes honey last so long?"
    assert extract_question("Question: Why do tides happen?\nMore text.") == "Why do tides happen?"
    assert extract_question("Sure! Here is one.\n1. How do glaciers move?") == "How do glaciers move?"
    assert extract_question("No question here.") is None
