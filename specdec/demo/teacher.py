"""Teacher data from the demo target: its own greedy chat answers (with the top-K log-probs
of every generation step) and its top-K log-probs on code chunks. Phase 3 of the demo build;
the exit adapters' distillation uses the same helpers (``specdec.demo.exit_adapter``).

An example is ``{"ids": [n] long, "pos": [m] long, "top_i": [m, K] int32, "top_v": [m, K]
float16}``: the rows at ``pos`` predict the next token; ``top_i`` / ``top_v`` are the target's.
"""

from __future__ import annotations

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


def generate_answers(model, tok, prompts: list[str], cfg: BuildConfig, desc: str) -> list[dict]:
    """Greedy chat answers; each example: ids (prompt+answer), pos (label positions), top ids/logp."""
    from transformers import LogitsProcessorList

    tok.padding_side = "left"
    enc = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"] for p in prompts]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    eos = tok.eos_token_id
    pad = tok.pad_token_id
    examples: list[dict | None] = [None] * len(enc)
    bar = tqdm(total=len(enc), desc=desc, unit="prompt")
    ntok = 0
    for b in range(0, len(order), cfg.gen_batch):
        idx = order[b:b + cfg.gen_batch]
        L = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, L - len(enc[i]):] = torch.tensor(enc[i])
            mask[r, L - len(enc[i]):] = 1
        rec = _TopK(cfg.topk)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
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
        bar.update(len(idx))
        bar.set_postfix(tokens=ntok)
    bar.close()
    return examples


def teacher_code(model, chunks: list[list[int]], cfg: BuildConfig, desc: str) -> list[dict]:
    W = model.lm_head.weight.float()
    out = []
    bs = 8
    for b in tqdm(range(0, len(chunks), bs), desc=desc, unit="batch"):
        ids = torch.tensor(chunks[b:b + bs])
        with torch.no_grad():
            h = model.model(input_ids=ids).last_hidden_state.float()
            lp = torch.log_softmax(h @ W.T, -1)
            v, i = lp.topk(cfg.topk, -1)
        for r in range(ids.shape[0]):
            n = ids.shape[1] - 1
            out.append({"ids": ids[r], "pos": torch.arange(n), "top_i": i[r, :n].to(torch.int32),
                        "top_v": v[r, :n].to(torch.float16)})
    return out
