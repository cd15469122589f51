"""Teacher data from the demo target: its own greedy chat answers (with the top-K log-probs
of every generation step) and its top-K log-probs on code chunks. Phase 3 of the demo build;
the exit adapters' distillation uses the same helpers (``specdec.demo.exit_adapter``).

An example is ``{"ids": [n] long, "pos": [m] long, "top_i": [m, K] int32, "top_v": [m, K]
float16}``: the rows at ``pos`` predict the next token; ``top_i`` / ``top_v`` are the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import BuildConfig


class _TopK:
    """LogitsProcessor that records top-K log-probs of every generation step (scores unchanged)."""

    def __init__(self, k: int):
        self.k, self.steps = k, []

    def __call__(self, input_ids, scores):
        lp = torch.log_softmax(scores.float(), -1)
        v, i = lp.topk(self.k, -1)
        self.steps.append((i.to(torch.int32), v.to(torch.float16)))
        return scores


def generate_answers(model, tok, prompts: list[str], cfg: BuildConfig, desc: str,
                     checkpoint: Path | None = None) -> list[dict]:
    """Greedy chat answers to ``prompts`` (through the chat template); see ``continue_greedily``."""
    enc = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    return continue_greedily(model, tok, enc, cfg, desc, checkpoint, cfg.max_new_tokens)


def continue_greedily(model, tok, enc: list[list[int]], cfg: BuildConfig, desc: str,
                      checkpoint: Path | None = None, max_new_tokens: int = 128) -> list[dict]:
    """The model's greedy continuations of the prompts ``enc`` (token ids); each example: ids
    (prompt+continuation), pos (label positions), top ids/logp of every generated token.

    ``checkpoint``: a directory where each finished batch is saved and found again, so an
    interrupted build resumes where it stopped (the batches do not depend on each other)."""
    from transformers import LogitsProcessorList

    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    examples: list[dict | None] = [None] * len(enc)
    bar = tqdm(total=len(enc), desc=desc, unit="prompt")
    ntok = 0
    for b in range(0, len(order), cfg.gen_batch):
        idx = order[b:b + cfg.gen_batch]
        saved = checkpoint / f"batch{b:05d}-{len(idx)}.pt" if checkpoint is not None else None
        if saved is not None and saved.is_file():
            for i, ex in zip(idx, torch.load(saved)):
                examples[i] = ex
                ntok += len(ex["pos"])
            bar.update(len(idx))
            continue
        L = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):  # left padding
            ids[r, L - len(enc[i]):] = torch.tensor(enc[i])
            mask[r, L - len(enc[i]):] = 1
        rec = _TopK(cfg.topk)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=eos,
                                 logits_processor=LogitsProcessorList([rec]))
        gen = out[:, L:]
        top_i = torch.stack([s[0] for s in rec.steps], 1)  # [B, T, K]
        top_v = torch.stack([s[1] for s in rec.steps], 1)
        for r, i in enumerate(idx):
            g = gen[r].tolist()
            n = g.index(eos) + 1 if eos in g else len(g)
            p = len(enc[i])
            examples[i] = {"ids": torch.tensor(enc[i] + g[:n]), "pos": torch.arange(p - 1, p - 1 + n),
                           "top_i": top_i[r, :n].clone(), "top_v": top_v[r, :n].clone()}
            ntok += n
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save([examples[i] for i in idx], saved.with_suffix(".tmp"))
            saved.with_suffix(".tmp").rename(saved)
        bar.update(len(idx))
        bar.set_postfix(tokens=ntok)
    bar.close()
    return examples


def teacher_code(model, chunks: list[list[int]], cfg: BuildConfig, desc: str) -> list[dict]:
    """The model's top-K log-probs at every position of each code chunk, and its features."""
    W = model.lm_head.weight.float()
    out = []
    bs = 8
    for b in tqdm(range(0, len(chunks), bs), desc=desc, unit="batch"):
        ids = torch.tensor(chunks[b:b + bs])
        with torch.no_grad():
            h = model.base_model(input_ids=ids).last_hidden_state.float()
            lp = torch.log_softmax(h @ W.T, -1)
            v, i = lp.topk(cfg.topk, -1)
        for r in range(ids.shape[0]):
            n = ids.shape[1] - 1
            out.append({"ids": ids[r], "pos": torch.arange(n), "top_i": i[r, :n].to(torch.int32),
                        "top_v": v[r, :n].to(torch.float16), "feat": h[r].to(torch.bfloat16)})
    return out


@torch.no_grad()
def add_features(model, examples: list[dict], desc: str, batch_tokens: int = 4096) -> None:
    """Give every example without one a ``feat`` [len(ids), d] (bfloat16): the model's final
    hidden state (after its final norm: what the LM head reads) at each position, the input
    of an EAGLE head (``specdec.models.eagle``). Batched by length, right-padded."""
    todo = sorted((i for i, ex in enumerate(examples) if "feat" not in ex), key=lambda i: len(examples[i]["ids"]))
    bar = tqdm(total=len(todo), desc=desc, unit="seq")
    while todo:
        L = len(examples[todo[0]]["ids"])
        n = 1
        while n < len(todo) and len(examples[todo[n]]["ids"]) * (n + 1) <= batch_tokens:
            n += 1
        idx, todo = todo[:n], todo[n:]
        L = max(len(examples[i]["ids"]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):
            m = len(examples[i]["ids"])
            ids[r, :m], mask[r, :m] = examples[i]["ids"], 1
        h = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        for r, i in enumerate(idx):
            examples[i]["feat"] = h[r, :len(examples[i]["ids"])].to(torch.bfloat16).clone()
        bar.update(len(idx))
    bar.close()
