from specdec.bench.divergence import greedy_divergence
from specdec.config import ModelConfig, SpeculationConfig
from specdec.engine import Engine


def test_fp32_speculation_never_diverges_and_the_report_counts_it(llama_pair):
    engine = Engine.load(
        ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]), dtype="float32"),
        SpeculationConfig(),
    )
    prompts = [engine.encode(prompt=p) for p in ("The cat sees", "A dog likes the", "Def f2(x):")]
    report = greedy_divergence(engine, prompts, mode="draft", max_tokens=24, k=4)
    assert report["identical"] == 3 and report["divergences"] == []


def test_a_divergence_is_located_with_its_top2_gap(llama_pair, monkeypatch):
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), dtype="float32"), SpeculationConfig())
    ids = engine.encode(prompt="The cat sees")
    real = engine.generate
    # Corrupt the speculative run's 5th token: the report must find position 4.
    def fake(prompt_ids, **kw):
        out = real(prompt_ids, **kw)
        if kw.get("mode") != "off":
            out.token_ids[4] = (out.token_ids[4] + 1) % 50
        return out

    monkeypatch.setattr(engine, "generate", fake)
    report = greedy_divergence(engine, [ids], mode="ngram", max_tokens=12)
    assert report["identical"] == 0 and report["divergences"][0]["position"] == 4
    assert report["divergences"][0]["top2_gap"] >= 0
