"""All model work of a process runs on one thread (``specdec.compute``): loading and every step."""

import threading

import pytest

from specdec import compute
from specdec.config import ModelConfig
from specdec.engine import Engine


def test_run_returns_raises_and_nests_on_one_thread():
    names = []

    def where():
        names.append(threading.current_thread().name)
        return compute.run(lambda: threading.current_thread().name)  # nested: runs inline, no deadlock

    assert compute.run(where) == "specdec-compute"
    threads = [threading.Thread(target=lambda: names.append(compute.run(lambda: threading.current_thread().name)))
               for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert set(names) == {"specdec-compute"}
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda x, y=0: x + y, 2, y=3) == 5  # the thread survives an exception


def test_an_engine_loads_and_steps_its_models_on_the_compute_thread(llama_pair):
    engine = Engine.load(ModelConfig(target=str(llama_pair["target"]), draft=str(llama_pair["draft"]),
                                     dtype="float32"))
    seen = set()
    # on their LM heads: a Llama step runs its layers without the model's own forward (specdec.batch.lean)
    hooks = [m.lm_head.register_forward_pre_hook(lambda *_: seen.add(threading.current_thread().name))
             for m in (engine.target_model, engine.draft_model)]
    try:
        out = engine.generate(engine.encode(prompt="The cat"), max_tokens=8, mode="draft", k=3)
    finally:
        [h.remove() for h in hooks]
    assert len(out.token_ids) == 8 and out.speculation.drafted_tokens > 0
    assert seen == {"specdec-compute"}
    engine.loop.close()
