"""The ``early_exit`` drafter: the target's first layers on the target's own token pool (fp32 tiny
pairs), on the batched path that ships: ``EarlyExitDrafter`` on a ``BatchRunner`` and the
engine's ``early_exit`` mode."""

import json
import threading
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

import specdec.demo as demo
from specdec.drafters.base import Drafted, DraftRow
from specdec.batch.blocks import blocks_for, run_of, slot, slots
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.config import ModelConfig, SpeculationConfig
from specdec.demo.exit_adapter import (ExitBuildConfig, TrainConfig, adapter_from_target, add_exit_adapters,
                                       build_exit_adapters, exit_features, train_exit_adapter)
from specdec.drafters.base import Proposal
from specdec.drafters.early_exit import EarlyExitDrafter, RawExit, ShallowStack, exit_parts
from specdec.engine import Engine
from specdec.models.exit_adapter import ExitAdapter, load_exit_adapter, save_exit_adapter
from specdec.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams
from specdec.bench.tiny import synthetic_corpus
from three_tokens import batched_result, batched_test_and_control

PROMPTS = [" ".join(p.split()[:4]) for p in synthetic_corpus(n_sentences=20, seed=99)]
EXIT = 2  # of the tiny targets' 4 layers
CAP = 208  # pool rows per sequence in the runner-level tests (13 whole blocks)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, llama_pair, gpt2_pair):
    paths = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return {"tokenizer": load_tokenizer(str(paths["target"])), "target": load_model(str(paths["target"])),
            "paths": paths, "arch": request.param}


@pytest.fixture(scope="module")
def engines(pair):
    """Raw exits after layer 2 in the engine, by confidence threshold (0: always draft k)."""
    out = {t: Engine.load(ModelConfig(target=str(pair["paths"]["target"]), dtype="float32", early_exit_layer=EXIT),
                          SpeculationConfig(mode="early_exit", num_speculative_tokens=3, early_exit_threshold=t),
                          kv_cache_tokens=4096)
           for t in (0.0, 0.6)}
    yield out
    for engine in out.values():
        engine.loop.close()


def hf_greedy(model, ids, n):
    """Plain greedy decoding by transformers (no EOS): the independent reference."""
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                         pad_token_id=0)[0, len(ids):].tolist()
    assert len(out) == n
    return out


def full_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def row(key, ids, num_logits, slot):
    return BatchRow(key, ids, num_logits, run_of(1 + blocks_for(CAP) * slot, CAP))


def draft_row(key, context, k, params, seed, slot):
    return DraftRow(key, context, k, params, seed, run_of(1 + blocks_for(CAP) * slot, CAP))


def pools(runner):
    """Copies of every layer's key and value pool."""
    return [t.clone() for t in runner.cache.keys], [t.clone() for t in runner.cache.values]


def changed_rows(a, b):
    """Per layer, the pool rows where two [heads, rows, dim] pools differ."""
    return [set(torch.nonzero((x != y).any(-1).any(0)).flatten().tolist()) for x, y in zip(a, b)]


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(before, model):
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_shallow_stack_is_the_full_models_first_layers(pair):
    """Layers 0..L-1 give the full model's hidden state after layer L-1: on a one-sequence
    cache (the demo's step timing), and token by token on a pool the full model prefilled,
    two rows at once, writing only layers 0..L-1 at the fed positions."""
    model, tok = pair["target"], pair["tokenizer"]
    seqs = [tok(PROMPTS[0] + " again and again")["input_ids"], tok(PROMPTS[5])["input_ids"]]
    prefix = [3, 2]  # tokens the full model prefills; the rest go through the shallow layers
    with torch.inference_mode():
        refs = [model(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
        for L in (1, 2, 3):
            stack = ShallowStack(model, L)
            cache = DynamicCache(config=model.config)
            h = stack.hidden(torch.tensor([seqs[0]]), cache)
            torch.testing.assert_close(h, refs[0][L], rtol=0, atol=1e-6)
            lengths = [layer.get_seq_length() for layer in cache.layers]
            assert lengths == [len(seqs[0])] * L + [0] * (len(lengths) - L)

            runner = BatchRunner(model, capacity_tokens=2 * CAP)
            runner.forward([row(f"s{i}", s[:m], 1, i) for i, (s, m) in enumerate(zip(seqs, prefix))])
            before = pools(runner)
            fed = set()
            for pos in range(min(prefix), max(map(len, seqs))):
                live = [i for i, s in enumerate(seqs) if prefix[i] <= pos < len(s)]
                hidden = stack.hidden_rows(runner, [f"s{i}" for i in live], [seqs[i][pos] for i in live],
                                           [pos] * len(live))
                for j, i in enumerate(live):
                    torch.testing.assert_close(hidden[j], refs[i][L][0, pos], rtol=0, atol=1e-5)
                    fed.add(slot(run_of(1 + blocks_for(CAP) * i, CAP), pos))
            after = pools(runner)
            for kind in (0, 1):
                rows = changed_rows(before[kind], after[kind])
                assert all(r == set() for r in rows[L:]), L  # the deeper layers never touched
                assert all(r == fed for r in rows[:L]), L  # exactly the fed positions, in layers 0..L-1
            # the runner's record of what each row holds did not move
            assert [runner.cached_ids(f"s{i}") for i in range(2)] == [s[:m] for s, m in zip(seqs, prefix)]


def test_reused_cache_gives_the_same_logits_as_a_separate_one(pair):
    """Round by round, two sequences drafted in one batch on the target's pool: each draft's q
    equals a cache-free early exit's; drafting writes only layers 0..L-1 at positions the
    verify pass rewrites, leaving what the rows hold bit for bit as on a pool no drafter
    touched; the verify logits equal that pool's bit for bit and a fresh forward's; after the
    verify the two pools are identical."""
    model, tok, params = pair["target"], pair["tokenizer"], SamplingParams(temperature=1.0)
    shared, separate = BatchRunner(model, capacity_tokens=2 * CAP), BatchRunner(model, capacity_tokens=2 * CAP)
    stack, head = exit_parts(model, EXIT)
    drafter = EarlyExitDrafter(shared, stack, head)
    seqs = {"s": tok(PROMPTS[1])["input_ids"], "t": tok(PROMPTS[9] + " again")["input_ids"]}
    slot = {"s": 0, "t": 1}
    for runner in (shared, separate):  # prefill; a verify pass leaves ids[:-1] in the cache
        runner.forward([row(key, ids[:-1], 1, slot[key]) for key, ids in seqs.items()])
    accepted = 0
    with torch.inference_mode():
        for r in range(6):
            before = pools(shared)
            proposals = dict(zip(seqs, drafter.propose(
                [draft_row(key, ids, 4, params, 10 * r + slot[key], slot[key]) for key, ids in seqs.items()]).proposals))
            drafted_at = set()
            for key, ids in seqs.items():
                proposal = proposals[key]
                assert len(proposal) == 4
                # (a) q of each draft = the early exit computed from scratch, no cache at all
                seq = ids + proposal.tokens
                hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[EXIT]
                ref_q = torch.softmax(head(hs[0, len(ids) - 1: len(seq) - 1]).float(), -1)
                torch.testing.assert_close(proposal.probs, ref_q, rtol=0, atol=1e-5)
                # (b) what the row holds is untouched: same record, same pool rows, every layer
                assert shared.cached_ids(key) == separate.cached_ids(key) == ids[:-1]
                held = slots(run_of(1 + blocks_for(CAP) * slot[key], CAP), 0, len(ids) - 1)
                for a, b in zip(shared.cache.keys + shared.cache.values, separate.cache.keys + separate.cache.values):
                    assert torch.equal(a[:, held], b[:, held])
                table = run_of(1 + blocks_for(CAP) * slot[key], CAP)
                drafted_at |= set(slots(table, len(ids) - 1, len(ids) - 1 + len(proposal)).tolist())  # context[-1] and all drafts but the last
            # drafting wrote layers 0..L-1 only, and only at positions the verify pass feeds
            after = pools(shared)
            for kind in (0, 1):
                rows = changed_rows(before[kind], after[kind])
                assert all(c == set() for c in rows[EXIT:]) and all(c <= drafted_at for c in rows[:EXIT])
                assert any(rows[:EXIT])
            # (c) one verify pass over both rows scores exactly what a separate draft cache would
            batch = [row(key, ids + proposals[key].tokens, len(proposals[key]) + 1, slot[key])
                     for key, ids in seqs.items()]
            got, want = shared.forward(batch), separate.forward(batch)
            for b, g, w in zip(batch, got, want):
                assert torch.equal(g, w)
                torch.testing.assert_close(g, full_logits(model, b.ids)[-b.num_logits:], rtol=1e-4, atol=1e-4)
            for a, b in zip(shared.cache.keys + shared.cache.values, separate.cache.keys + separate.cache.values):
                assert torch.equal(a, b)  # the verify pass rewrote every position the draft wrote
            for (key, ids), g in zip(list(seqs.items()), got):
                proposal = proposals[key]
                n = 0
                while n < len(proposal) and int(g[n].argmax()) == proposal.tokens[n]:
                    n += 1
                accepted += n
                seqs[key] = ids + proposal.tokens[:n] + [int(g[n].argmax())]
                for runner in (shared, separate):
                    runner.truncate(key, len(seqs[key]) - 1)
    assert accepted > 0


def test_a_failing_draft_leaves_the_shared_cache_intact(pair):
    """A head that fails mid-draft (after two shallow passes): the runner's record is as before,
    its lock is free, and the next verify pass gives a clean pool's logits bit for bit."""
    model, ids = pair["target"], pair["tokenizer"](PROMPTS[3])["input_ids"]
    runner, plain = BatchRunner(model, capacity_tokens=CAP), BatchRunner(model, capacity_tokens=CAP)
    for r in (runner, plain):
        r.forward([row("s", ids[:-1], 1, 0)])
    stack, raw = exit_parts(model, EXIT)
    calls = []

    def flaky(h):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("exit head failed")
        return raw(h)

    drafter = EarlyExitDrafter(runner, stack, raw)
    drafter.head = flaky  # fails on the third draft step, after two shallow passes
    with pytest.raises(RuntimeError, match="exit head failed"):
        drafter.propose([draft_row("s", ids, 5, SamplingParams(), 0, 0)])
    assert runner.cached_ids("s") == ids[:-1]
    free = []

    def take_the_lock():  # from another thread: an RLock held by this one would block it
        if runner.lock.acquire(timeout=5):
            runner.lock.release()
            free.append(True)

    t = threading.Thread(target=take_the_lock)
    t.start()
    t.join()
    assert free == [True]
    assert torch.equal(runner.forward([row("s", ids, 1, 0)])[0], plain.forward([row("s", ids, 1, 0)])[0])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain_decoding(pair, engines, k):
    """Through the engine's early_exit mode, with and without a confidence stop: the target's
    own greedy tokens (transformers), every round drafting at the asked k (the stop only cuts
    a round short), with drafts really accepted."""
    model = pair["target"]
    accepted, cut_short = 0, 0
    for prompt in PROMPTS[:8]:
        ids = engines[0.0].encode(prompt=prompt)
        ref = hf_greedy(model, ids, 24)
        for threshold, engine in engines.items():
            res = engine.generate(ids, max_tokens=24, mode="early_exit", k=k, ignore_eos=True)
            assert res.token_ids == ref, (prompt, k, threshold)
            left = 24 - res.rounds[0].emitted
            for r in res.rounds[1:]:
                kk = min(k, left - 1)
                assert (r.mode, r.k) == (("early_exit", kk) if kk else ("off", 0)), (prompt, k, threshold, r)
                assert (0 < r.drafted <= kk) if kk else r.drafted == 0
                if threshold == 0.0:
                    assert r.drafted == kk
                cut_short += r.drafted < kk
                left -= r.emitted
            accepted += res.speculation.accepted_tokens
    assert accepted > 8 * k, accepted  # drafts were really accepted along the way
    if k > 1:
        assert cut_short > 0  # the engine's threshold 0.6 did stop rounds early


def test_confidence_threshold_stops_rounds_early(pair):
    """Per row of one batch: threshold 0 drafts k, 1 stops after the first token, and a middle
    threshold stops right after the first token whose exit probability is below it."""
    model, tok = pair["target"], pair["tokenizer"]
    ctxs = [tok(PROMPTS[2])["input_ids"], tok(PROMPTS[8])["input_ids"]]
    runner = BatchRunner(model, capacity_tokens=2 * CAP)
    runner.forward([row(f"r{i}", c[:-1], 1, i) for i, c in enumerate(ctxs)])
    stack, raw = exit_parts(model, EXIT)

    def propose(threshold, k, params):
        drafter = EarlyExitDrafter(runner, stack, raw, threshold)
        return drafter.propose([draft_row(f"r{i}", c, k, params, 0, i) for i, c in enumerate(ctxs)]).proposals

    for threshold, expect in ((0.0, 5), (1.0, 1)):  # 1.0: every token is "unsure"
        assert [len(p) for p in propose(threshold, 5, SamplingParams())] == [expect, expect]
    full = propose(0.0, 6, SamplingParams(1.0, top_k=1))  # the greedy tokens, drawn as samples
    got = propose(0.5, 6, SamplingParams())
    stops = []
    for c, q, g in zip(ctxs, full, got):
        with torch.inference_mode():
            probs = torch.softmax(raw(_exit_hidden(model, c, q.tokens)).float(), -1)
        conf = probs[torch.arange(len(q)), torch.tensor(q.tokens)]
        stop = next((i + 1 for i, x in enumerate(conf.tolist()) if x < 0.5), len(q))
        assert g.tokens == q.tokens[:stop]
        stops.append(stop)
    assert any(stop < 6 for stop in stops)  # the middle threshold did cut a round short
    assert [runner.cached_ids(f"r{i}") for i in range(2)] == [c[:-1] for c in ctxs]


def _exit_hidden(model, ids, drafts):
    with torch.inference_mode():
        seq = torch.tensor([ids + drafts])
        return model(input_ids=seq, output_hidden_states=True).hidden_states[EXIT][0, len(ids) - 1: -1]


class _MisreportsQ:
    """Negative control: draws its tokens at twice the temperature but reports the q of the
    request's temperature (a q row that is not the one sampled from: the bug class that breaks
    exactness; dropping q altogether would not, a point mass is verified exactly)."""

    name = "early_exit"

    def __init__(self, inner: EarlyExitDrafter):
        self.inner = inner

    def propose(self, rows) -> Drafted:
        hot = self.inner.propose([replace(r, params=replace(r.params, temperature=2 * r.params.temperature))
                                  for r in rows])
        out = []
        for p in hot.proposals:
            sq = p.probs ** 2  # top-k keeps the same support at any temperature: q_T ~ q_2T ** 2
            out.append(Proposal(tokens=p.tokens, probs=sq / sq.sum(-1, keepdim=True)))
        return Drafted(out, hot.seconds, hot.steps)

    def release(self, key):
        self.inner.release(key)


def test_sampled_early_exit_has_the_target_distribution(llama_pair, monkeypatch):
    """Chi-square over the first 3 sampled tokens (top_k=3: 27 cells) at significance 1e-3, 2000
    seeded samples of the engine's early_exit mode batched 16 at a time; cells expected below 5
    pooled. Two negative controls fail the same test at the same size: a verifier that accepts
    every draft (its output is the exit's distribution), and a drafter whose reported q is not
    the one it sampled from."""
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), dtype="float32", early_exit_layer=EXIT),
                         kv_cache_tokens=4096)
    ids = engine.encode(prompt=PROMPTS[4])
    n = 2000
    honest, accept_all = batched_test_and_control(engine, ids, n, "early_exit", monkeypatch)
    assert honest["drafted"] >= n and honest["impossible"] == 0 and honest["p"] > 1e-3, honest
    assert accept_all["impossible"] > 0 or accept_all["p"] < 1e-3, accept_all
    monkeypatch.undo()  # the honest verifier again
    monkeypatch.setitem(engine.loop.target.drafters, "early_exit", _MisreportsQ(engine.loop.target.drafters["early_exit"]))
    misreported = batched_result(engine, ids, n, "early_exit")
    assert misreported["drafted"] >= n
    assert misreported["impossible"] > 0 or misreported["p"] < 1e-3, misreported
    engine.loop.close()


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
    # the saved adapter drafts in the engine (it names its exit layer): greedy output is the
    # target's own, and drafting leaves the engine's target as it was
    engine = Engine.load(ModelConfig(target=str(pair["paths"]["target"]), dtype="float32",
                                     early_exit_adapter=str(tmp_path / "exit" / f"layer{EXIT}")),
                         kv_cache_tokens=1024)
    drafter = engine.loop.target.drafters["early_exit"]
    assert isinstance(drafter.head, ExitAdapter) and drafter.stack.num_layers == EXIT
    engine_before = state(engine.target_model)
    ids = engine.encode(prompt=PROMPTS[6])
    spec = engine.generate(ids, max_tokens=30, mode="early_exit", k=4, ignore_eos=True)
    assert spec.token_ids == hf_greedy(model, ids, 30)
    assert spec.speculation.mode == "early_exit" and spec.speculation.accepted_tokens > 0
    assert_same_state(engine_before, engine.target_model)
    assert_same_state(before, model)
    engine.loop.close()


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
    stack, head = exit_parts(model, adapter=str(tmp_path / "a"))  # the adapter names its layer
    assert stack.num_layers == EXIT and torch.equal(head(h), adapter(h))
    with pytest.raises(ValueError, match="trained for layer"):
        exit_parts(model, EXIT + 1, str(tmp_path / "a"))


def test_training_only_moves_the_adapter(llama_pair):
    model = load_model(str(llama_pair["target"]))
    before = state(model)
    adapter = adapter_from_target(model, EXIT, None, 64)
    head_before = adapter.head.weight.detach().clone()
    feats = exit_features(model, _sequences(load_tokenizer(str(llama_pair["target"])), PROMPTS), [EXIT])
    train_exit_adapter(adapter, feats["h"][EXIT], feats["top_i"], feats["top_v"], TrainConfig(steps=5, batch=64))
    assert not torch.equal(adapter.head.weight, head_before)  # it trained ...
    assert_same_state(before, model)  # ... on copies: the target's tied head did not move


def test_engine_mode_early_exit_and_auto(pair, engines):
    engine = engines[0.0]
    assert "early_exit" in engine.drafters and "draft" not in engine.drafters
    target = engine.loop.target
    assert target.drafters["early_exit"].runner is target.runner  # one cache, shared
    ids = engine.encode(prompt=PROMPTS[7])
    plain = engine.generate(ids, max_tokens=30, mode="off")
    spec = engine.generate(ids, max_tokens=30, mode="early_exit", k=3)
    assert spec.token_ids == plain.token_ids
    assert spec.speculation.mode == "early_exit" and spec.speculation.accepted_tokens > 0
    auto = engine.generate(ids, max_tokens=30, mode="auto")
    assert auto.token_ids == plain.token_ids
    policy = engine.loop._new_policy(engine.request(ids, max_tokens=1, mode="auto"))
    assert set(policy.modes) == {"ngram", "early_exit"}  # auto chooses among both
    with pytest.raises(ValueError):
        ModelConfig(target="x", early_exit_layer=0)


def test_a_drafter_failing_on_the_target_side_leaves_the_request_plain_and_exact(pair, engines, monkeypatch):
    """A target-side drafter that raises: its rows run as plain steps (the round says why), the
    request's tokens are plain decoding's, and the drafter is retried after a few rounds."""
    engine = engines[0.0]
    ids = engine.encode(prompt=PROMPTS[5])
    plain = engine.generate(ids, max_tokens=30, mode="off")
    real, calls = engine.loop.target.drafters["early_exit"], []

    class Flaky:
        name = "early_exit"

        def propose(self, rows):
            calls.append(len(rows))
            if len(calls) == 1:
                raise RuntimeError("exit head failed")
            return real.propose(rows)

        def release(self, key):
            real.release(key)

    monkeypatch.setitem(engine.loop.target.drafters, "early_exit", Flaky())
    spec = engine.generate(ids, max_tokens=30, mode="early_exit", k=3)
    assert spec.token_ids == plain.token_ids
    failed = [r for r in spec.rounds if r.draft_error]
    assert len(failed) == 1 and "exit head failed" in failed[0].draft_error and failed[0].drafted == 0
    assert len(calls) > 1 and spec.speculation.accepted_tokens > 0  # drafting came back, and paid


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
    (root / "medusa").mkdir()
    for name in ("specdec_medusa.json", "medusa.safetensors"):
        (root / "medusa" / name).write_text("{}")
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

    import specdec.demo.shipped as shipped

    monkeypatch.setattr(build_mod, "build", boom)
    monkeypatch.setattr(exit_mod, "add_exit_adapters", fake_add)
    monkeypatch.setattr(shipped, "install_exit", lambda root, weights=None: False)  # none shipped: a build
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
