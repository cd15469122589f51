"""Model and speculation configuration as users name them: hub revisions, remote code off unless
asked, the tokenizer's source, a context cap, aliases, vLLM's speculation names, the fingerprint."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import specdec.loading as runner_mod
from specdec.hardware import resolve_dtype
from specdec.batch.runner import BatchRunner
from specdec.config import ModelConfig, SpeculationConfig
from specdec.engine import draft_tokenizer, target_tokenizer
from specdec.loading import load_model


def test_revision_and_remote_code_reach_from_pretrained(monkeypatch, llama_pair):
    seen = []

    def spy(name, **kwargs):
        seen.append((name, kwargs))
        raise RuntimeError("stop here")

    monkeypatch.setattr(runner_mod.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(runner_mod.AutoTokenizer, "from_pretrained", spy)
    with pytest.raises(RuntimeError):
        load_model("org/model", revision="abc123")
    assert seen[-1][1]["revision"] == "abc123" and seen[-1][1]["trust_remote_code"] is False
    models = ModelConfig(target="org/model", revision="v1", draft="org/draft", draft_revision="v2",
                         tokenizer="org/tok", trust_remote_code=True)
    for load in (target_tokenizer, draft_tokenizer):
        with pytest.raises(RuntimeError):
            load(models)
    assert seen[-2] == ("org/tok", {"revision": None, "trust_remote_code": True})  # the named tokenizer
    assert seen[-1] == ("org/draft", {"revision": "v2", "trust_remote_code": True})
    with pytest.raises(RuntimeError):
        target_tokenizer(ModelConfig(target="org/model", revision="v1"))
    assert seen[-1] == ("org/model", {"revision": "v1", "trust_remote_code": False})


def test_max_model_len_caps_the_context(llama_pair):
    model = load_model(str(llama_pair["target"]))
    assert BatchRunner(model, capacity_tokens=1024).max_length == 512
    assert BatchRunner(model, capacity_tokens=1024, max_length=100).max_length == 100
    assert BatchRunner(model, capacity_tokens=1024, max_length=4096).max_length == 512  # never above the model's


def test_vllm_speculation_names_are_aliases():
    ours = SpeculationConfig(mode="ngram", num_speculative_tokens=5, ngram_min=2, ngram_max=3)
    theirs = SpeculationConfig.model_validate(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert theirs == ours
    assert SpeculationConfig.model_validate({"method": "draft_model"}).mode == "draft"
    with pytest.raises(ValidationError, match="implements"):
        SpeculationConfig.model_validate({"method": "eagle3"})
    with pytest.raises(ValidationError, match="give one of them"):
        SpeculationConfig.model_validate({"method": "ngram", "mode": "draft"})


def test_aliases_and_the_fingerprint():
    assert ModelConfig(target="t").names == ["t"]
    assert ModelConfig(target="t", served_model_name="a").names == ["a"]
    models = ModelConfig(target="t", served_model_name=["a", "b"])
    assert models.names == ["a", "b"] and models.name == "a"
    bf16 = models.model_copy(update={"dtype": "bfloat16"}).fingerprint
    fp32 = models.model_copy(update={"dtype": "float32"}).fingerprint
    assert bf16 != fp32 and "bfloat16" in bf16 and "float32" in fp32
    assert resolve_dtype("auto", "cpu") in models.fingerprint  # what auto chose, not "auto"
    assert models.fingerprint == ModelConfig(target="t", served_model_name=["a", "b"]).fingerprint


def test_dtype_auto_takes_bf16_only_where_it_is_native(monkeypatch):
    """auto on a CPU: bf16 with native bf16 instructions; without them fp32 on fp16 weights where
    FBGEMM's fp16 product runs, fp32 where it does not; on a GPU bf16."""
    import specdec.hardware as hardware

    assert ModelConfig(target="t").dtype == "auto"
    monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: False)
    for half in (True, False):
        monkeypatch.setattr(hardware, "half_available", lambda half=half: half)
        without = "float16-weights" if half else "float32"
        for flags, want in [({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"), ({"avx2", "amx_bf16"}, "bfloat16"),
                            ({"avx2", "avx512f"}, without), (set(), without)]:
            monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
            assert resolve_dtype("auto", "auto") == want, (flags, half)
            assert resolve_dtype("float16", "cpu") == "float16"  # an explicit dtype is kept
            assert resolve_dtype("float32", "cpu") == "float32"
    monkeypatch.setattr(hardware.torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    # this machine's answer agrees with its CPU flags
    monkeypatch.undo()
    native = hardware.native_bf16()
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float16-weights" if hardware.half_available()
                                            else "float32")
    # a model's format, for the target and the draft; a head's loader does not pack it: refused at the edge
    assert ModelConfig(target="t", dtype="float16-weights", draft_dtype="float16-weights").dtype == "float16-weights"
    for head in ("eagle_dtype", "medusa_dtype"):
        with pytest.raises(ValidationError, match=head):
            ModelConfig(target="t", **{head: "float16-weights"})


def test_units_of_one_application_have_distinct_names():
    from deployments.config import AppArgs

    one = {"models": {"target": "a", "served_model_name": ["x", "y"]}}
    assert len(AppArgs.model_validate({**one, "units": [{"models": {"target": "b"}}]}).units) == 1
    with pytest.raises(ValidationError, match="'y' is served by two units"):
        AppArgs.model_validate({**one, "units": [{"models": {"target": "b", "served_model_name": "y"}}]})
