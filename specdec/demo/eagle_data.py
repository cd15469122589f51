"""Teacher data from diverse prompts (``specdec.demo.diverse_prompts``) for the EAGLE head.

The target answers the prompts greedily (generation in ``cfg.diverse_gen_dtype``: bfloat16 is
faster on CPUs with AVX-512 BF16); then one float32 forward per example, teacher-forced on
prompt + answer, recomputes the top-K log-probs at the answer positions and the features, so
the labels are the float32 target's own distribution at each context. Self-instruct: the
target first writes questions about topics (``self_instruct_seeds``), which join the prompts.
Docstring answers (``docstring_examples``, no generation): a question about a stdlib function
answered with its docstring, labelled with the target's distribution at each answer token (as
EAGLE-1 trained on fixed chat data rather than the target's own answers).

Every stage checkpoints under ``work`` (generation per batch, the results as a whole), so an
interrupted run resumes. Examples have the teacher format (``specdec.demo.teacher``) plus
``feat``.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.loading import DTYPES

from .config import BuildConfig
from .diverse_prompts import diverse_prompts, extract_question, self_instruct_seeds, stdlib_entries
from .teacher import generate_answers


@torch.no_grad()
def teacher_force(model, examples: list[dict], topk: int, desc: str, batch_tokens: int = 2048) -> None:
    """Recompute in place ``top_i`` / ``top_v`` (at each example's ``pos``) and ``feat`` (every
    position) with one forward of ``model`` over the example's ids (float32 logits)."""
    W = model.get_output_embeddings().weight
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    bar = tqdm(total=len(order), desc=desc, unit="seq")
    while order:
        n = 1
        while n < len(order) and len(examples[order[n]]["ids"]) * (n + 1) <= batch_tokens:
            n += 1
        idx, order = order[:n], order[n:]
        L = max(len(examples[i]["ids"]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):  # right padding: causal, the padding is never attended to
            m = len(examples[i]["ids"])
            ids[r, :m], mask[r, :m] = examples[i]["ids"], 1
        h = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        for r, i in enumerate(idx):
            ex = examples[i]
            hp = h[r, ex["pos"]]
            v, t = torch.log_softmax((hp @ W.T).float(), -1).topk(topk, -1)
            ex["top_i"], ex["top_v"] = t.to(torch.int32), v.to(torch.float16)
            ex["feat"] = h[r, :len(ex["ids"])].to(torch.bfloat16).clone()
        bar.update(len(idx))
    bar.close()


def _cached(path: Path, make):
    if path.is_file():
        return torch.load(path)
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return value


def self_instruct_questions(model, tok, cfg: BuildConfig, work: Path, heldout: list[str] = ()) -> list[str]:
    """The target's own questions (greedy, ``cfg.self_instruct_tokens`` tokens) to the seeds;
    distinct, not held-out prompts."""
    seeds = self_instruct_seeds(cfg.seed, cfg.n_self_instruct)
    gcfg = replace(cfg, max_new_tokens=cfg.self_instruct_tokens)
    replies = generate_answers(model, tok, seeds, gcfg, "self-instruct questions", work / "self_instruct")
    out, seen = [], set(heldout)
    for ex, s in zip(replies, seeds):
        n = len(ex["pos"])
        q = extract_question(tok.decode(ex["ids"][len(ex["ids"]) - n:].tolist()))
        if q and q not in seen:
            seen.add(q)
            out.append(q)
    return out


def docstring_examples(tok, files: list[Path], n: int, seed: int) -> list[dict]:
    """``n`` chat examples (ids, pos; labels to be computed): "What does `m.f` do?" answered
    with the first paragraph of its docstring, from the (training) ``files``."""
    import random

    entries = stdlib_entries(sorted(files), limit=4 * n)
    random.Random(seed + 303).shuffle(entries)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for m, f, doc in entries[:n]:
        enc = list(tok.apply_chat_template([{"role": "user", "content": f"What does `{m}.{f}` do?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        ans = tok(doc, add_special_tokens=False)["input_ids"] + ([end] if isinstance(end, int) and end >= 0 else [])
        out.append({"ids": torch.tensor(enc + ans), "pos": torch.arange(len(enc) - 1, len(enc) - 1 + len(ans))})
    return out


def diverse_teacher(target, tok, train_files: list[Path], heldout: list[str], cfg: BuildConfig,
                    work: Path) -> tuple[list[dict], dict]:
    """(examples, stats): the target's answers to ``cfg.n_diverse`` diverse prompts plus its
    self-instruct questions, and ``cfg.n_docstring_answers`` docstring answers, all labelled
    teacher-forced in float32."""
    work = Path(work)

    def make():
        gen = copy.deepcopy(target).to(DTYPES[cfg.diverse_gen_dtype]).eval()
        prompts = diverse_prompts(cfg.seed, cfg.n_diverse, train_files, heldout)
        questions = self_instruct_questions(gen, tok, cfg, work, heldout + prompts) if cfg.n_self_instruct else []
        gcfg = replace(cfg, max_new_tokens=cfg.diverse_new_tokens)
        examples = generate_answers(gen, tok, prompts + questions, gcfg, "target answers (diverse prompts)",
                                    work / "answers")
        del gen
        docs = docstring_examples(tok, train_files, cfg.n_docstring_answers, cfg.seed)
        fp32 = copy.deepcopy(target).float().eval()
        teacher_force(fp32, examples + docs, cfg.topk, "float32 labels and features (diverse prompts)")
        stats = {"prompts": len(prompts), "self_instruct_questions": len(questions),
                 "docstring_answers": len(docs), "docstring_answer_tokens": sum(len(e["pos"]) for e in docs),
                 "answer_tokens": sum(len(e["pos"]) for e in examples), "gen_dtype": cfg.diverse_gen_dtype,
                 "max_new_tokens": cfg.diverse_new_tokens}
        return {"examples": examples + docs, "stats": stats, "prompts": prompts + questions}

    saved = _cached(work / "diverse.pt", make)
    return saved["examples"], saved["stats"]
