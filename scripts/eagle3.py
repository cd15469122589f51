"""EAGLE-3 head for the demo target, outside the hour-long build (the same functions).

``python scripts/eagle3.py data WORK``: held-out chat/code sets (as the build makes them),
stdlib code chunks and the diverse-prompt teacher data, each cached under WORK (resumable).
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


def data(work: Path, cfg) -> dict:
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
    diverse, stats = diverse_teacher(target, tok, corpus.train_files, corpus.held_prompts + corpus.train_prompts,
                                     cfg, work / "diverse")
    times["diverse_s"] = round(time.time() - t, 1)
    t = time.time()
    code = cached(work / "code.pt", lambda: teacher_code(target, corpus.chunks[:cfg.n_code_chunks // 2], cfg, "stdlib code"))
    times["code_s"] = round(time.time() - t, 1)
    out = {"diverse": stats, "code_examples": len(code), "heldout_chat": len(held["chat"]), **times}
    (work / "data.json").write_text(json.dumps(out, indent=2))
    return {"held": held, "diverse": diverse, "code": code, "stats": out}


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
    ap.add_argument("--prev-json", type=Path, help="ship: the previous head's `eval` output (JSON)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = BuildConfig()
    if args.cmd == "data":
        log.info("data: %s", data(args.work, cfg)["stats"])
    else:
        from eagle3_train import evaluate, ship, train  # noqa: E402 (the training half of this script)

        if args.cmd == "ship":
            args.prev = json.loads(args.prev_json.read_text())
        {"train": train, "eval": evaluate, "ship": ship}[args.cmd](args, cfg)


if __name__ == "__main__":
    main()
