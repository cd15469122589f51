"""The ``eagle`` drafter: a one-layer head on the target's own features (fp32 tiny pairs).

Heads are trained here on the frozen tiny targets (a few seconds each). Greedy output equals
plain decoding at k = 1, 3, 6 with many drafts accepted; sampled output keeps the target's
distribution (chi-square at 1e-3 with a negative control); the feature pool leaves the
target's logits untouched; files (ours and EAGLE-1's layout) load.
"""

import json

import pytest
import torch

from specdec.batch.blocks import run_of, slots

from specdec.batch.runner import BatchRow, BatchRunner
from specdec.config import ModelConfig, SpeculationConfig
from specdec.demo.config import BuildConfig
from specdec.demo.eagle import EagleTrainConfig, eagle_agreement, init_eagle_head, train_eagle
from specdec.demo.teacher import teacher_code
from specdec.engine import Engine
from specdec.models.eagle import EagleHead, eagle_config, load_eagle_head, save_eagle_head
from specdec.loading import load_model, load_tokenizer
from specdec.bench.tiny import synthetic_corpus
from three_tokens import batched_test_and_control, greedy_accepted

PROMPTS = [" ".join(p.split()[:4]) for p in synthetic_corpus(n_sentences=20, seed=99)]


def chunks(tok, seed: int, n: int, length: int = 64) -> list[list[int]]:
    ids = tok(" ".join(synthetic_corpus(n_sentences=40 * n, seed=seed)))["input_ids"]
    return [ids[i:i + length] for i in range(0, len(ids) - length, length)][:n]


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def trained(request, llama_pair, gpt2_pair, tmp_path_factory):
    """A head trained on the tiny target's own top-K and features, saved; and the metrics."""
    paths = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    model, tok = load_model(str(paths["target"])), load_tokenizer(str(paths["target"]))
    before = state(model)
    cfg = BuildConfig(topk=8)
    train = teacher_code(model, chunks(tok, 5, 48), cfg, "teacher")
    held = teacher_code(model, chunks(tok, 6, 8), cfg, "teacher")
    tcfg = EagleTrainConfig(steps=150, batch_tokens=2048, lr=3e-3, warmup=10)
    head = init_eagle_head(model, torch.arange(model.config.vocab_size), tcfg)
    untrained = eagle_agreement(head, held)
    train_eagle(head, train, tcfg)
    out = tmp_path_factory.mktemp(f"eagle_{request.param}")
    save_eagle_head(head, out, dtype=torch.float32)
    return {"paths": paths, "head_dir": out, "model": model, "tok": tok, "before": before, "held": held,
            "untrained": untrained, "agreement": eagle_agreement(head, held), "head": head}


def test_training_only_moves_the_head_and_it_learns(trained):
    after = trained["model"].state_dict()
    assert all(torch.equal(trained["before"][k], after[k]) for k in after)  # the target is frozen
    assert trained["agreement"] > 0.5 > trained["untrained"], (trained["agreement"], trained["untrained"])


@pytest.fixture(scope="module")
def engine(trained):
    return Engine.load(ModelConfig(target=str(trained["paths"]["target"]), dtype="float32",
                                   eagle_head=str(trained["head_dir"])),
                       SpeculationConfig(mode="eagle", num_speculative_tokens=3), kv_cache_tokens=4096)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain_decoding(engine, k):
    assert "eagle" in engine.drafters
    accepted = 0
    for prompt in PROMPTS[:8]:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=30, mode="off")
        spec = engine.generate(ids, max_tokens=30, mode="eagle", k=k)
        assert spec.token_ids == plain.token_ids, (prompt, k)
        assert spec.speculation.mode == "eagle"
        accepted += spec.speculation.accepted_tokens
    assert accepted > 50, accepted


def test_a_float16_weights_target_runs_its_head_on_fp16_weights_and_stays_exact(trained):
    """``eagle_dtype: auto`` follows a ``float16-weights`` target: every product of the head, its
    rows of the target's LM head too, on fp16 weights (a draft step reads half the bytes); its
    logits are the matmul's on those weights to fp32 rounding, and greedy output is still plain
    decoding's, with drafts accepted. ``eagle_dtype: float32`` keeps the head's fp32 weights."""
    from specdec.models import packed

    if not packed.half_available():
        pytest.skip("no FBGEMM fp16 products on this machine")
    target, head_dir = str(trained["paths"]["target"]), str(trained["head_dir"])
    engine = Engine.load(ModelConfig(target=target, dtype="float16-weights", eagle_head=head_dir),
                         SpeculationConfig(mode="eagle", num_speculative_tokens=3), kv_cache_tokens=4096)
    head = engine.loop.target.drafters["eagle"].head
    layers = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m, packed.PackedLinear) and m.half for m in layers) and head.rows.half
    features = torch.randn(1, 5, head.config.hidden_size)
    with torch.inference_mode():
        got = head.reduced_logits(features)
    assert head.rows._packed is not None  # the packed product ran
    torch.testing.assert_close(got, features @ head.head_weight.T, rtol=1e-5, atol=1e-5)
    accepted = greedy_accepted(engine, PROMPTS[:4], "eagle", 3)
    assert accepted > 0
    fp32 = Engine.load(ModelConfig(target=target, dtype="float16-weights", eagle_head=head_dir, eagle_dtype="float32"),
                       SpeculationConfig(mode="eagle"), kv_cache_tokens=1024).loop.target.drafters["eagle"].head
    assert not fp32.rows.half and not any(isinstance(m, packed.PackedLinear) and m.half for m in fp32.modules())


@pytest.mark.parametrize("nodes,width,k", [(8, 2, 3), (16, 4, 5), (16, 8, 8)])
def test_eagle_tree_greedy_equals_plain_decoding(engine, nodes, width, k):
    """EAGLE-2-style dynamic trees from the head: the same tokens, longer accepted paths; a deep
    wide tree (width 8) near the end of a request outgrows the row's range and is cut to it."""
    from specdec.policy import PolicyConfig

    engine.policy_config = PolicyConfig(tree_nodes=nodes)
    engine.loop.target.drafters["eagle"].tree_width = width
    accepted = {"eagle": 0, "eagle_tree": 0}
    for prompt in PROMPTS[:8]:
        ids = engine.encode(prompt=prompt)
        plain = engine.generate(ids, max_tokens=30, mode="off")
        for mode in accepted:
            spec = engine.generate(ids, max_tokens=30, mode=mode, k=k)
            assert spec.token_ids == plain.token_ids, (prompt, mode, nodes, width, k)
            assert all(r.draft_error is None for r in spec.rounds), (prompt, mode)
            accepted[mode] += spec.speculation.accepted_tokens
    engine.policy_config = PolicyConfig()
    assert accepted["eagle"] > 50, accepted
    if width <= 4:  # a tree of 16 nodes 8 wide is shallow: a chain of 8 may go deeper
        assert accepted["eagle_tree"] >= accepted["eagle"], accepted


def test_eagle_in_a_batch_with_other_modes_and_auto(engine):
    """Rows of every mode share steps; each gets its plain tokens; auto may choose eagle."""
    import threading

    ids = [engine.encode(prompt=p) for p in PROMPTS[8:14]]
    plain = [engine.generate(i, max_tokens=24, mode="off").token_ids for i in ids]
    got = {}

    def run(j):
        got[j] = engine.generate(ids[j], max_tokens=24, mode=["eagle", "auto", "ngram"][j % 3], k=2 + j % 3).token_ids

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(ids))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert [got[j] for j in range(len(ids))] == plain
    policy = engine.loop._new_policy(engine.request(ids[0], max_tokens=1, mode="auto"))
    assert set(policy.modes) == {"ngram", "eagle", "eagle_tree"}


def test_sampled_eagle_has_the_target_distribution(engine, monkeypatch):
    """Chi-square over the first 3 sampled tokens (top_k=3: 27 cells) at significance 1e-3,
    2000 seeded samples batched 16 at a time. Negative control: a verifier that accepts every
    draft (its output is the head's distribution) fails the same test."""
    if engine.loop.target.runner.model.config.model_type != "llama":
        pytest.skip("one architecture suffices: verification never looks at the model")
    ids = engine.encode(prompt=PROMPTS[4])
    n = 2000
    honest, control = batched_test_and_control(engine, ids, n, "eagle", monkeypatch)
    assert honest["drafted"] >= n and honest["impossible"] == 0 and honest["p"] > 1e-3
    assert control["impossible"] > 0 or control["p"] < 1e-3


def test_the_feature_pool_leaves_the_logits_alone(trained):
    """The verify pass keeps features through a hook: logits equal a runner without it, and
    the kept features are the target's final hidden states at those positions."""
    model, tok = trained["model"], trained["tok"]
    a, b = BatchRunner(model, capacity_tokens=512), BatchRunner(model, capacity_tokens=512)
    b.keep_features()
    x, y = tok(PROMPTS[0] + " " + PROMPTS[1])["input_ids"], tok(PROMPTS[2])["input_ids"]
    steps = [[BatchRow("x", x[:5], 0, run_of(1, 200)), BatchRow("y", y, 2, run_of(14, 200))],
             [BatchRow("x", x, 3, run_of(1, 200)), BatchRow("y", y + [7, 9], 3, run_of(14, 200))],
             [BatchRow("y", y + [7], 1, run_of(14, 200))]]  # a rollback, then one more token
    for rows in steps:
        for got, want in zip(b.forward(rows), a.forward(rows)):
            assert torch.equal(got, want)
    with torch.no_grad():
        for ids, first in ((x, 1), (y + [7], 14)):
            ref = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            torch.testing.assert_close(b.features[slots(run_of(first, 200), 0, len(ids))], ref, rtol=1e-4, atol=1e-5)


def test_save_load_and_refusals(trained, tmp_path):
    model, head = trained["model"], trained["head"]
    loaded = load_eagle_head(trained["head_dir"], model)
    f, ids, pos = torch.randn(1, 5, head.config.hidden_size), torch.tensor([[3, 4, 5, 6, 7]]), torch.arange(5)[None]
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    with torch.no_grad():  # the loaded head's layers are packed (another kernel): equal to rounding
        torch.testing.assert_close(loaded(f, ids, pos), head(f, ids, pos), rtol=1e-5, atol=1e-5)
    other = type(model.config)(**{**model.config.to_dict(), "vocab_size": model.config.vocab_size + 64})
    bigger = type(model)(other)
    with pytest.raises(ValueError, match="vocabulary"):
        load_eagle_head(trained["head_dir"], bigger)
    with pytest.raises(FileNotFoundError):
        load_eagle_head(tmp_path, model)


def test_an_eagle1_checkpoint_layout_loads(trained, tmp_path):
    """EAGLE-1's released heads: config.json + ``fc.*`` / ``layers.0.*`` (no input norm, no
    output norm, the target's full LM head). Saved that way, it predicts what the same
    weights in an ``EagleHead`` predict, and it drafts exactly."""
    model = trained["model"]
    cfg = eagle_config(model.config)
    ref = EagleHead(cfg, model.config.vocab_size, input_norm=False, output_norm=False).bind_target(model).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    sd = {"fc.weight": ref.fc.weight, "fc.bias": ref.fc.bias}
    sd |= {"layers.0." + k: v for k, v in ref.layer.state_dict().items()}
    sd["embed_tokens.weight"] = model.get_input_embeddings().weight  # released heads carry it; unused
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    loaded = load_eagle_head(tmp_path, model)
    assert not loaded.input_norm and not loaded.output_norm and len(loaded.token_ids) == model.config.vocab_size
    f, ids, pos = torch.randn(1, 4, cfg.hidden_size), torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(loaded(f, ids, pos)), ref.logits(ref(f, ids, pos)))
    engine = Engine.load(ModelConfig(target=str(trained["paths"]["target"]), dtype="float32",
                                     eagle_head=str(tmp_path)), kv_cache_tokens=1024)
    ids = engine.encode(prompt=PROMPTS[3])
    assert engine.generate(ids, max_tokens=12, mode="eagle", k=3).token_ids == \
        engine.generate(ids, max_tokens=12, mode="off").token_ids
