"""The ``early_exit`` drafter: the target's first layers on the target's own cache (fp32 tiny pairs)."""

import json
from dataclasses import replace

import pytest
import torch

import specdec.demo as demo
from specdec.config import ModelConfig, SpeculationConfig
from specdec.decoding import DecodeRequest, LocalTarget, decode
from specdec.demo.exit_adapter import (ExitBuildConfig, TrainConfig, adapter_from_target, add_exit_adapters,
                                       build_exit_adapters, exit_features, train_exit_adapter)
from specdec.drafters.base import Proposal
from specdec.drafters.early_exit import EarlyExitDrafter, RawExit, ShallowStack
from specdec.engine import Engine
from specdec.models.exit_adapter import load_exit_adapter, save_exit_adapter
from specdec.runner import ModelRunner
from specdec.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams
from specdec.bench.tiny import synthetic_corpus
from three_tokens import three_token_pvalue

PROMPTS = [" ".join(p.split()[:4]) for p in synthetic_corpus(n_sentences=20, seed=99)]
EXIT = 2  # of the tiny targets' 4 layers


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, llama_pair, gpt2_pair):
    paths = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return {"tokenizer": load_tokenizer(str(paths["target"])), "target": load_model(str(paths["target"])),
            "paths": paths, "arch": request.param}


def run(model, prompt_ids, max_tokens, *, k=4, exit_layer=EXIT, head=None, threshold=0.0,
        params=SamplingParams(), seq_id="seq"):
    runner = ModelRunner(model)  # one runner: the drafter shares the target's caches
    drafter = None if k == 0 else EarlyExitDrafter(runner, exit_layer, head, threshold=threshold)
    request = DecodeRequest(prompt_ids, max_tokens, params=params, seq_id=seq_id)
    steps = list(decode(LocalTarget(runner), drafter, request, k=k))
    return [t for s in steps for t in s.tokens], steps


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(before, model):
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_shallow_stack_is_the_full_models_first_layers(pair):
    model = pair["target"]
    ids = torch.tensor([pair["tokenizer"](PROMPTS[0] + " again and again")["input_ids"]])
    runner = ModelRunner(model)
    with torch.inference_mode():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states
        for L in (1, 2, 3):
            cache = runner._seq(f"s{L}").cache
            h = ShallowStack(model, L).hidden(ids, cache)
            torch.testing.assert_close(h, ref[L], rtol=0, atol=1e-6)
            # layers 0..L-1 hold the tokens, the deeper ones were never touched
            lengths = [layer.get_seq_length() for layer in cache.layers]
            assert lengths == [ids.shape[1]] * L + [0] * (len(lengths) - L)


def test_reused_cache_gives_the_same_logits_as_a_separate_one(pair):
    """Round by round: the drafts' q equals a cache-free early exit's; after drafting, the shared
    cache is bit-identical to a cache no drafter touched, and so are the verify logits."""
    model, params = pair["target"], SamplingParams(temperature=1.0)
    shared, separate = ModelRunner(model), ModelRunner(model)
    drafter = EarlyExitDrafter(shared, EXIT)
    head = RawExit(drafter.stack)
    ids = pair["tokenizer"](PROMPTS[1])["input_ids"]
    for runner in (shared, separate):  # prefill; a verify pass leaves ids[:-1] in the cache
        runner.forward("s", ids, 1)
        runner.rollback("s", len(ids) - 1)
    with torch.inference_mode():
        for r in range(6):
            proposal = drafter.propose("s", ids, 4, params, seed=r)
            # (a) q of each draft = the early exit computed from scratch, no cache at all
            seq = ids + proposal.tokens
            hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[EXIT]
            ref_q = torch.softmax(head(hs[0, len(ids) - 1: len(seq) - 1]).float(), -1)
            torch.testing.assert_close(proposal.probs, ref_q, rtol=0, atol=1e-5)
            # (b) the shared cache is bit for bit the one no drafter touched (all layers)
            a, b = shared._seqs["s"], separate._seqs["s"]
            assert a.ids == b.ids == ids[:-1]
            for la, lb in zip(a.cache.layers, b.cache.layers):
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
            # (c) so the verify pass scores exactly what it would with a separate draft cache
            got = shared.forward("s", seq, len(proposal) + 1)
            want = separate.forward("s", seq, len(proposal) + 1)
            assert torch.equal(got, want)
            accepted = 0
            while accepted < len(proposal) and int(got[accepted].argmax()) == proposal.tokens[accepted]:
                accepted += 1
            ids = ids + proposal.tokens[:accepted] + [int(got[accepted].argmax())]
            for runner in (shared, separate):
                runner.rollback("s", len(ids) - 1)


def test_a_failing_draft_leaves_the_shared_cache_intact(pair):
    """decode() survives a drafter error with a plain round: the cache must be whole again."""
    model, ids = pair["target"], pair["tokenizer"](PROMPTS[3])["input_ids"]
    runner, plain = ModelRunner(model), ModelRunner(model)
    for r in (runner, plain):
        r.forward("s", ids[:-1], 1)
    raw, calls = RawExit(ShallowStack(model, EXIT)), []

    def flaky(h):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("exit head failed")
        return raw(h)

    drafter = EarlyExitDrafter(runner, EXIT, raw)
    drafter.head = flaky  # fails on the third draft step, after two shallow passes
    with pytest.raises(RuntimeError, match="exit head failed"):
        drafter.propose("s", ids, 5, SamplingParams(), seed=0)
    lengths = {layer.get_seq_length() for layer in runner._seqs["s"].cache.layers}
    assert lengths == {len(ids) - 1}
    assert torch.equal(runner.forward("s", ids, 1), plain.forward("s", ids, 1))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain_decoding(pair, k):
    model, tok = pair["target"], pair["tokenizer"]
    accepted = 0
    for prompt in PROMPTS[:8]:
        ids = tok(prompt)["input_ids"]
        ref, _ = run(model, ids, 24, k=0)
        for threshold in (0.0, 0.6):
            out, steps = run(model, ids, 24, k=k, threshold=threshold)
            assert out == ref, (prompt, k, threshold)
            assert all(s.stats.drafted <= k for s in steps)
            accepted += sum(s.stats.accepted for s in steps)
    assert accepted > 8 * k, accepted  # drafts were really accepted along the way


def test_confidence_threshold_stops_rounds_early(pair):
    model, ids = pair["target"], pair["tokenizer"](PROMPTS[2])["input_ids"]
    runner = ModelRunner(model)
    runner.forward("s", ids[:-1], 1)
    for threshold, expect in ((0.0, 5), (1.0, 1)):  # 1.0: every token is "unsure"
        drafter = EarlyExitDrafter(runner, EXIT, threshold=threshold)
        proposal = drafter.propose("s", ids, 5, SamplingParams(), seed=0)
        assert len(proposal) == expect
    # a middle threshold stops right after the first token whose exit probability is below it
    drafter = EarlyExitDrafter(runner, EXIT, threshold=0.5)
    q = EarlyExitDrafter(runner, EXIT).propose("s", ids, 6, SamplingParams(1.0, top_k=1), seed=0)
    with torch.inference_mode():
        full = torch.softmax(RawExit(drafter.stack)(_exit_hidden(model, ids, q.tokens)).float(), -1)
    conf = full[torch.arange(len(q)), torch.tensor(q.tokens)]
    stop = next((i + 1 for i, c in enumerate(conf.tolist()) if c < 0.5), len(q))
    assert drafter.propose("s", ids, 6, SamplingParams(), seed=0).tokens == q.tokens[:stop]


def _exit_hidden(model, ids, drafts):
    with torch.inference_mode():
        seq = torch.tensor([ids + drafts])
        return model(input_ids=seq, output_hidden_states=True).hidden_states[EXIT][0, len(ids) - 1: -1]


def _three_token_test(model, ids, make_drafter, n):
    """p-value of chi-square over the first 3 sampled tokens (top_k=3: 27 cells)."""
    runner = ModelRunner(model)
    pvalue, drafted = three_token_pvalue(model, ids, LocalTarget(runner), make_drafter(runner), n=n, k=2)
    assert drafted >= n  # every sample went through at least one drafted round
    return pvalue


class _MisreportsQ(EarlyExitDrafter):
    """Negative control: draws its tokens at twice the temperature but reports the q of the
    request's temperature (a q row that is not the one sampled from: the bug class that breaks
    exactness; dropping q altogether would not, a point mass is verified exactly)."""

    def propose(self, seq_id, context, k, params, seed):
        hot = super().propose(seq_id, context, k, replace(params, temperature=2 * params.temperature), seed)
        rows = hot.probs**2  # top-k keeps the same support at any temperature: q_T ~ q_2T ** 2
        return Proposal(tokens=hot.tokens, probs=rows / rows.sum(-1, keepdim=True))


def test_sampled_early_exit_has_the_target_distribution(llama_pair):
    """Chi-square at significance 1e-3 with 1000 seeded samples (test_decoding uses 3000 for the
    draft pair; 1000 keep this file fast: ~9 ms a sample here). Cells expected below 5 are
    pooled. The sample size is justified by the negative control: a drafter whose reported q is
    not the one it sampled from fails the same test at the same size with p ~ 1e-19."""
    model = load_model(str(llama_pair["target"]))
    ids = load_tokenizer(str(llama_pair["target"]))(PROMPTS[4])["input_ids"]
    assert _three_token_test(model, ids, lambda r: EarlyExitDrafter(r, EXIT), 1000) > 1e-3
    assert _three_token_test(model, ids, lambda r: _MisreportsQ(r, EXIT), 1000) < 1e-3


def _sequences(tok, texts):
    out = []
    for text in texts:
        ids = torch.tensor(tok(text)["input_ids"])
        out.append({"ids": ids, "pos": torch.arange(len(ids) - 1)})
    return out


def test_trained_adapter_leaves_the_target_unchanged_and_drafts_exactly(pair, tmp_path):
    model, tok = pair["target"], pair["tokenizer"]
    before = state(model)
    corpus = synthetic_corpus(n_sentences=400, seed=5)
    train = _sequences(tok, [" ".join(corpus[i:i + 8]) for i in range(0, 320, 8)])
    held = _sequences(tok, [" ".join(corpus[i:i + 8]) for i in range(320, 400, 8)])
    token_ids = torch.arange(0, model.config.vocab_size, 2)  # a reduced head: every other id
    # untrained, the adapter IS the raw exit (on its vocabulary)
    adapter = adapter_from_target(model, EXIT, token_ids, 128)
    h = exit_features(model, held, [EXIT])["h"][EXIT].float()
    raw = RawExit(ShallowStack(model, EXIT))(h)
    with torch.no_grad():
        torch.testing.assert_close(adapter(h)[:, token_ids], raw[:, token_ids], rtol=1e-4, atol=1e-4)
    assert torch.isinf(adapter(h)[:, 1::2]).all()
    # the demo path end to end: features, distillation, agreement, files, the build's own check
    cfg = ExitBuildConfig(exit_layers=(1, EXIT), intermediate_size=128, steps=60, batch=256, lr=3e-3)
    metrics = build_exit_adapters(tmp_path / "exit", model, token_ids, train, {"code": held}, cfg)
    assert_same_state(before, model)
    assert metrics["target_unchanged"] is True
    m = metrics["layers"][str(EXIT)]
    assert m["agreement"]["code"] > m["raw_exit_reduced_head_agreement"]["code"], m
    # the saved adapter drafts in the decoding loop: greedy output is the target's own
    head = load_exit_adapter(tmp_path / "exit" / f"layer{EXIT}", target_config=model.config)
    ids = tok(PROMPTS[6])["input_ids"]
    out, steps = run(model, ids, 30, k=4, head=head)
    assert out == run(model, ids, 30, k=0)[0]
    assert sum(s.stats.accepted for s in steps) > 0
    assert_same_state(before, model)


def test_adapter_save_load_and_mismatch(pair, tmp_path):
    model = pair["target"]
    adapter = adapter_from_target(model, EXIT, None, 96, seed=3)
    with torch.no_grad():
        adapter.down.weight.normal_(0, 0.1)  # not the identity any more
    save_exit_adapter(adapter, tmp_path / "a", model.config)
    loaded = load_exit_adapter(tmp_path / "a", target_config=model.config)
    h = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(loaded(h), adapter(h))
    assert loaded.exit_layer == EXIT and not loaded.training
    other = type(model.config)(**{**model.config.to_dict(), "vocab_size": model.config.vocab_size + 1})
    with pytest.raises(ValueError, match="vocab_size"):
        load_exit_adapter(tmp_path / "a", target_config=other)
    with pytest.raises(ValueError, match="trained for layer"):
        EarlyExitDrafter(ModelRunner(model), EXIT + 1, loaded)


def test_training_only_moves_the_adapter(llama_pair):
    model = load_model(str(llama_pair["target"]))
    before = state(model)
    adapter = adapter_from_target(model, EXIT, None, 64)
    head_before = adapter.head.weight.detach().clone()
    feats = exit_features(model, _sequences(load_tokenizer(str(llama_pair["target"])), PROMPTS), [EXIT])
    train_exit_adapter(adapter, feats["h"][EXIT], feats["top_i"], feats["top_v"], TrainConfig(steps=5, batch=64))
    assert not torch.equal(adapter.head.weight, head_before)  # it trained ...
    assert_same_state(before, model)  # ... on copies: the target's tied head did not move


def test_engine_mode_early_exit_and_auto(pair):
    paths = pair["paths"]
    engine = Engine.load(ModelConfig(target=str(paths["target"]), dtype="float32", early_exit_layer=EXIT),
                         SpeculationConfig(mode="early_exit", num_speculative_tokens=3))
    assert "early_exit" in engine.drafters and "draft" not in engine.drafters
    target = engine.loop.target
    assert target.early_exit.runner is target.runner  # one cache, shared
    ids = engine.encode(prompt=PROMPTS[7])
    plain = engine.generate(ids, max_tokens=30, mode="off")
    spec = engine.generate(ids, max_tokens=30, mode="early_exit", k=3)
    assert spec.token_ids == plain.token_ids
    assert spec.speculation.mode == "early_exit" and spec.speculation.accepted_tokens > 0
    auto = engine.generate(ids, max_tokens=30, mode="auto")
    assert auto.token_ids == plain.token_ids
    policy = engine.loop._new_policy(engine.request(ids, max_tokens=1, mode="auto"))
    assert set(policy.switch.drafters) == {"ngram", "early_exit"}  # auto chooses among both
    with pytest.raises(ValueError):
        ModelConfig(target="x", early_exit_layer=0)


def _fake_demo(root, model_type):
    for sub in ("tokenizer", "target", "draft"):
        (root / sub).mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / sub / name).write_text("{}")
    for name in ("specdec_draft.json", "draft.safetensors", "embeddings.safetensors"):
        (root / "draft" / name).write_text("{}")
    (root / "target" / "config.json").write_text(json.dumps({"model_type": model_type}))
    (root / "target" / "model.safetensors").write_bytes(b"x")
    (root / "eagle").mkdir()
    for name in ("specdec_eagle.json", "eagle.safetensors"):
        (root / "eagle" / name).write_text("{}")
    (root / "metrics.json").write_text("{}")


def test_a_cached_demo_gets_the_exit_added_without_a_rebuild(tmp_path, monkeypatch):
    import specdec.demo.build as build_mod
    import specdec.demo.exit_adapter as exit_mod

    def boom(*a, **k):
        raise AssertionError("target/draft must not be rebuilt")

    calls = []

    def fake_add(root, cfg=None):
        calls.append(root)
        (root / "exit" / "layer8").mkdir(parents=True)
        for name in ("specdec_exit.json", "exit.safetensors"):
            (root / "exit" / "layer8" / name).write_text("{}")
        (root / "exit" / "exit.json").write_text(json.dumps({"layers": {"8": {}}}))

    monkeypatch.setattr(build_mod, "build", boom)
    monkeypatch.setattr(exit_mod, "add_exit_adapters", fake_add)
    home = tmp_path / "home"
    _fake_demo(home / "demo", "llama")
    assert demo.build_demo_models(home) == home / "demo" and calls == []  # not asked for
    assert demo.build_demo_models(home, early_exit=True) == home / "demo"
    assert calls == [home / "demo"]  # added once ...
    demo.build_demo_models(home, early_exit=True)
    assert calls == [home / "demo"]  # ... then a cache hit
    assert demo.demo_paths(home)["exit"] == home / "demo" / "exit"
    other = tmp_path / "home2"
    _fake_demo(other / "demo", None)  # not a real target: skipped, never a rebuild
    assert demo.build_demo_models(other, early_exit=True) == other / "demo" and len(calls) == 1


def test_add_exit_adapters_to_a_tiny_demo_cache(llama_pair, tmp_path, monkeypatch):
    """The real add path on a tiny stand-in cache: teacher data from build.py's helpers, adapters
    in exit/, metrics merged into metrics.json, target files untouched."""
    import hashlib

    from safetensors.torch import save_file

    root = tmp_path / "demo"
    tok = load_tokenizer(str(llama_pair["target"]))
    tok.pad_token = tok.eos_token
    model = load_model(str(llama_pair["target"]))
    model.save_pretrained(root / "target")
    for d in ("target", "tokenizer"):
        tok.save_pretrained(root / d)
    (root / "draft").mkdir()
    save_file({"token_ids": torch.arange(0, model.config.vocab_size, 2)}, str(root / "draft" / "draft.safetensors"))
    (root / "metrics.json").write_text(json.dumps({"draft": {"agreement_code_heldout": 0.2}}))
    digest = hashlib.sha256((root / "target" / "model.safetensors").read_bytes()).hexdigest()
    cfg = ExitBuildConfig(exit_layers=(EXIT,), intermediate_size=64, steps=10, batch=128, n_chat_train=4,
                          n_chat_heldout=2, max_new_tokens=8, n_code_chunks=4, n_code_eval_chunks=2)
    import specdec.demo.exit_adapter as exit_mod

    monkeypatch.setattr(exit_mod, "_draft_agreement", lambda *a: 0.0)  # no demo draft in this stand-in
    metrics = add_exit_adapters(root, cfg)
    saved = json.loads((root / "metrics.json").read_text())
    assert saved["draft"] == {"agreement_code_heldout": 0.2}
    assert saved["early_exit"] == json.loads(json.dumps(metrics))
    assert set(metrics["heldout_positions"]) == {"code", "chat"} and metrics["train_positions"] > 100
    assert metrics["target_unchanged"] and demo._exit_complete(root)
    assert hashlib.sha256((root / "target" / "model.safetensors").read_bytes()).hexdigest() == digest
    assert load_exit_adapter(root / "exit" / f"layer{EXIT}").exit_layer == EXIT
