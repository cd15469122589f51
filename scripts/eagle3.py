"""EAGLE-3 head for the demo target, outside the hour-long build (the same functions).

``python scripts/eagle3.py data WORK [--engine N]``: held-out chat/code sets (as the build makes
them), stdlib code chunks and the diverse-prompt teacher data, each cached under WORK (resumable).
``--engine N``: the diverse data are instead N diverse prompts answered greedily by specdec's own
batched engine (the served dtype, ``--new-tokens`` each, many rows a step: several times faster
than ``generate()`` on a CPU), plus the docstring answers; labels and features in float32 as before.
``--code-chunks N``: that many stdlib code chunks (default: half the build's 240).
``python scripts/eagle3.py train WORK [--init DIR] [--ttt N] [--steps N]``: train a head
(checkpointed under WORK every few steps), save it to WORK/eagle, measure held-out agreement.
``python scripts/eagle3.py eval WORK DIR``: held-out agreement of the head in DIR at depths 1-3.
``python scripts/eagle3.py ship WORK DIR --ttt N --prev-json F``: ship the head trained in DIR.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

DEMO = Path.home() / ".cache/specdec/demo"
log = logging.getLogger("eagle3")


def load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def cached(path: Path, make):
    if path.is_file():
        return torch.load(path)
    t = time.time()
    value = make()
    torch.save(value, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    log.info("%s made in %.1f s", path.name, time.time() - t)
    return value


def data(work: Path, cfg, engine_prompts: int = 0, new_tokens: int = 128, code_chunks: int = 0) -> dict:
    from specdec.demo.build import _phase_corpus
    from specdec.demo.eagle_data import diverse_teacher
    from specdec.demo.teacher import add_features, generate_answers, teacher_code

    work.mkdir(parents=True, exist_ok=True)
    target, tok = load_target()
    corpus = _phase_corpus(tok, cfg, {})
    times = {}

    def heldout():
        chat = generate_answers(target, tok, corpus.held_prompts, cfg, "target answers (held-out prompts)",
                                work / "chat_eval")
        add_features(target, chat, "target features (held-out)")
        return {"chat": chat, "code": teacher_code(target, corpus.eval_chunks, cfg, "held-out code")}

    t = time.time()
    held = cached(work / "heldout.pt", heldout)
    times["heldout_s"] = round(time.time() - t, 1)
    t = time.time()
    if engine_prompts:
        diverse, stats = engine_teacher(target, tok, corpus, cfg, work / "diverse", engine_prompts, new_tokens)
    else:
        diverse, stats = diverse_teacher(target, tok, corpus.train_files,
                                         corpus.held_prompts + corpus.train_prompts, cfg, work / "diverse")
    times["diverse_s"] = round(time.time() - t, 1)
    t = time.time()
    n_code = code_chunks or cfg.n_code_chunks // 2
    code = cached(work / "code.pt", lambda: teacher_code(target, corpus.chunks[:n_code], cfg, "stdlib code"))
    times["code_s"] = round(time.time() - t, 1)
    out = {"diverse": stats, "code_examples": len(code), "heldout_chat": len(held["chat"]), **times}
    (work / "data.json").write_text(json.dumps(out, indent=2))
    return {"held": held, "diverse": diverse, "code": code, "stats": out}


def engine_teacher(target, tok, corpus, cfg, work: Path, n: int, new_tokens: int,
                   rows: int = 32) -> tuple[list[dict], dict]:
    """``diverse_teacher``'s examples from ``n`` diverse prompts (none equal to a held-out, template
    or benchmark prompt) answered greedily by specdec's Engine (the demo pair's served dtype,
    ``rows`` requests a step), plus the docstring answers; labelled teacher-forced in float32.
    Answers are checkpointed as they finish (``work/engine_answers.pt``), so a run resumes."""
    import argparse
    import copy
    import threading

    from specdec.bench.sweep import models_from_args
    from specdec.bench.workloads import CHAT_QUESTIONS
    from specdec.config import ModelConfig
    from specdec.demo.diverse_prompts import diverse_prompts
    from specdec.demo.eagle_data import docstring_examples, teacher_force
    from specdec.engine import Engine
    from specdec.hardware import resolve_dtype

    work.mkdir(parents=True, exist_ok=True)
    final = work / "diverse.pt"
    if final.is_file():
        saved = torch.load(final)
        return saved["examples"], saved["stats"]
    banned = corpus.held_prompts + corpus.train_prompts + list(CHAT_QUESTIONS)
    prompts = diverse_prompts(cfg.seed, n, corpus.train_files, banned)
    part = work / "engine_answers.pt"
    answers: dict[int, list[int]] = torch.load(part) if part.is_file() else {}
    models = models_from_args(argparse.Namespace(target=None, draft=None, dtype="auto"))
    enc = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    todo = [i for i in range(len(prompts)) if i not in answers]
    lock, t0, done = threading.Lock(), time.time(), [0, 0]

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            res = engine.generate(enc[i], max_tokens=new_tokens, mode="off")
            ids = list(res.token_ids) + ([eos] if res.finish_reason == "stop" and res.token_ids[-1:] != [eos] else [])
            with lock:
                answers[i] = ids
                done[0] += 1
                done[1] += len(ids)
                if done[0] % 64 == 0:
                    torch.save(answers, part.with_suffix(".tmp"))
                    part.with_suffix(".tmp").rename(part)
                    log.info("engine answers: %d/%d, %.1f tok/s", len(answers), len(prompts),
                             done[1] / (time.time() - t0))

    if todo:
        engine = Engine.load(ModelConfig(target=models["target"], dtype=models["dtype"]), max_num_seqs=rows)
        threads = [threading.Thread(target=worker) for _ in range(rows)]
        [th.start() for th in threads]
        [th.join() for th in threads]
        engine.loop.close()
        del engine  # its caches: the float32 pass below needs the memory
        torch.save(answers, part.with_suffix(".tmp"))
        part.with_suffix(".tmp").rename(part)
    gen_s = time.time() - t0
    examples = []
    for i in range(len(prompts)):
        p, a = enc[i], answers[i]
        examples.append({"ids": torch.tensor(p + a), "pos": torch.arange(len(p) - 1, len(p) - 1 + len(a))})
    docs = docstring_examples(tok, corpus.train_files, cfg.n_docstring_answers, cfg.seed)
    teacher_force(copy.deepcopy(target).float().eval(), examples + docs, cfg.topk,
                  "float32 labels and features (engine answers)")
    stats = {"prompts": len(prompts), "answer_tokens": sum(len(e["pos"]) for e in examples),
             "docstring_answers": len(docs), "docstring_answer_tokens": sum(len(e["pos"]) for e in docs),
             "generated_by": f"specdec Engine ({resolve_dtype(models['dtype'])}, greedy, {rows} rows a step)",
             "generation_s_this_run": round(gen_s, 1), "max_new_tokens": new_tokens}
    torch.save({"examples": examples + docs, "stats": stats, "prompts": prompts}, final.with_suffix(".tmp"))
    final.with_suffix(".tmp").rename(final)
    return examples + docs, stats


def main() -> None:
    from specdec.demo.config import BuildConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["data", "train", "eval", "ship"])
    ap.add_argument("work", type=Path)
    ap.add_argument("dir", nargs="?", type=Path)
    ap.add_argument("--init", type=Path)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--decay", type=float, default=0.8, help="train: the weight ratio of successive TTT steps")
    ap.add_argument("--budget", type=float, help="train: a wall-clock cap in seconds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", type=int, default=0, help="data: N diverse prompts answered by specdec's engine")
    ap.add_argument("--new-tokens", type=int, default=128, help="data --engine: tokens an answer")
    ap.add_argument("--code-chunks", type=int, default=0, help="data: stdlib code chunks (default: half the build's)")
    ap.add_argument("--prev-json", type=Path, help="ship: the previous head's `eval` output (JSON)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = BuildConfig()
    if args.cmd == "data":
        log.info("data: %s", data(args.work, cfg, args.engine, args.new_tokens, args.code_chunks)["stats"])
    else:
        from eagle3_train import evaluate, ship, train  # noqa: E402 (the training half of this script)

        if args.cmd == "ship":
            args.prev = json.loads(args.prev_json.read_text())
        {"train": train, "eval": evaluate, "ship": ship}[args.cmd](args, cfg)


if __name__ == "__main__":
    main()
