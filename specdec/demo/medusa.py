"""Training Medusa heads on the frozen target by self-distillation (the demo build's Medusa phase,
or added to a finished demo cache on its own: ``add_medusa_heads``; tests use it on tiny
models). The heads' definition and file format are :mod:`specdec.models.medusa`.

Data: teacher examples (``specdec.demo.teacher``): ``ids`` [n], the target's features ``feat``
[n, d] at every position, and its top-K log-probs ``top_i`` / ``top_v`` at the label positions
``pos`` (the row at ``pos[m]`` predicts ``ids[pos[m] + 1]``). Chat answers and code
continuations are the target's own greedy text, so what it predicts there is what it accepts.

Loss: head ``i`` on the feature at position ``t`` learns the target's distribution at position
``t + i + 1`` (the token ``t + i + 2``): cross-entropy against its top-K, restricted to the head
vocabulary and renormalised (its argmax is the target's greedy token). All heads train at
once on the same feature rows; only the ResBlocks train (the LM-head rows are the target's,
read, never copied into the optimiser). Seeded, float32, a fixed number of AdamW steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.models.medusa import MedusaHeads, load_medusa_heads, save_medusa_heads

from .config import BuildConfig
from .corpus import code_chunks, file_heads, function_snippets, split_files, stdlib_files
from .prompts import chat_prompts
from .teacher import add_features, continue_greedily, generate_answers, teacher_code


@dataclass
class MedusaTrainConfig:
    seed: int = 0
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 400  # ~3.5 epochs of the add path's data; 1200 steps agreed no better held out
    batch_rows: int = 512  # feature rows per step (each trains every head with a label there)
    lr: float = 2e-3
    warmup: int = 20
    topk: int = 8  # of the target's top-K log-probs, the soft labels' support
    budget_s: float | None = None  # a wall-clock cap (breaks determinism when it binds)


def init_medusa_heads(target, token_ids: torch.Tensor, cfg: MedusaTrainConfig) -> MedusaHeads:
    """Fresh float32 heads for ``target`` over the vocabulary ``token_ids`` (seeded)."""
    torch.manual_seed(cfg.seed)
    d = target.get_output_embeddings().weight.shape[1]
    heads = MedusaHeads(d, target.config.vocab_size, cfg.num_heads, cfg.num_layers,
                        head_vocab_size=len(token_ids)).float()
    heads.token_ids = token_ids.clone().long()
    return heads.bind_target(target)


def medusa_rows(examples: list[dict], num_heads: int, token_ids: torch.Tensor, vocab_size: int, topk: int):
    """Flatten ``examples`` into training rows: one per position ``t`` whose head 0 has a label.

    Returns ``feat`` [R, d] (bf16 as stored), ``hi`` [R, K, topk] head-vocabulary columns of the
    target's top tokens at ``t + i + 1`` (0 where outside it), ``p`` [R, K, topk] their
    renormalised probabilities (0 outside the head vocabulary), ``valid`` [R, K] (head ``i`` has
    a label: ``t + i + 1`` is a label position) and ``greedy`` [R, K] the target's greedy token
    there (full-vocabulary id, -1 where invalid)."""
    full2head = torch.full((vocab_size,), -1, dtype=torch.long)
    full2head[token_ids] = torch.arange(len(token_ids))
    feats, his, ps, valids, greedys = [], [], [], [], []
    for ex in examples:
        n = len(ex["ids"])
        lab = torch.full((n + num_heads + 1,), -1, dtype=torch.long)  # position -> label index
        lab[ex["pos"]] = torch.arange(len(ex["pos"]))
        t = torch.arange(n)
        t = t[lab[t + 1] >= 0]  # rows: head 0 has a label
        if not len(t):
            continue
        at = torch.stack([lab[t + i + 1] for i in range(num_heads)], 1)  # [r, K] label index or -1
        valid = at >= 0
        top_i, top_v = ex["top_i"][:, :topk].long(), ex["top_v"][:, :topk].float()
        ti, tv = top_i[at.clamp_min(0)], top_v[at.clamp_min(0)]  # [r, K, topk]
        hi = full2head[ti]
        p = tv.exp() * (hi >= 0)
        feats.append(ex["feat"][t])
        his.append(hi.clamp_min(0))
        ps.append(p / p.sum(-1, keepdim=True).clamp_min(1e-6))
        valids.append(valid)
        greedys.append(torch.where(valid, ti[..., 0], -1))
    return torch.cat(feats), torch.cat(his), torch.cat(ps), torch.cat(valids), torch.cat(greedys)


def medusa_loss(heads: MedusaHeads, feat: torch.Tensor, hi: torch.Tensor, p: torch.Tensor, valid: torch.Tensor):
    """(loss, [K] top-1 agreement on the head vocabulary) of one batch of rows.
    feat [B, d]; hi, p [B, K, topk]; valid [B, K]."""
    logits = heads.reduced_logits(feat.float())  # [B, K, H]
    logq = torch.log_softmax(logits, -1)
    ce = -(p * logq.gather(-1, hi)).sum(-1)  # [B, K]
    loss = (ce * valid).sum() / valid.sum().clamp_min(1)
    hit = (logits.argmax(-1) == hi[..., 0]) & valid
    agree = hit.sum(0).float() / valid.sum(0).clamp_min(1)
    return loss, agree


def train_medusa(heads: MedusaHeads, examples: list[dict], cfg: MedusaTrainConfig,
                 desc: str = "training Medusa heads") -> dict:
    """Train ``heads`` in place (float32, AdamW, warmup + cosine); deterministic given the seed."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 31)
    feat, hi, p, valid, _ = medusa_rows(examples, heads.num_heads, heads.token_ids, heads.vocab_size, cfg.topk)
    params = [q for q in heads.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    heads.train()
    t0, ema, queue, step, seen = time.time(), None, torch.empty(0, dtype=torch.long), 0, 0
    ema_acc = None
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", file=sys.stderr)
    for step in bar:
        if cfg.budget_s is not None and time.time() - t0 > cfg.budget_s:
            tqdm.write(f"[specdec demo] Medusa training budget reached after {step} steps", file=sys.stderr)
            break
        if len(queue) < cfg.batch_rows:  # a fresh seeded permutation per epoch
            queue = torch.cat([queue, torch.randperm(len(feat), generator=gen)])
        b, queue = queue[:cfg.batch_rows], queue[cfg.batch_rows:]
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * (
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        loss, acc = medusa_loss(heads, feat[b], hi[b], p[b], valid[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seen += len(b)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        bar.set_postfix(loss=f"{ema:.3f}", agree="/".join(f"{a:.2f}" for a in ema_acc.tolist()),
                        rows_s=f"{seen / (time.time() - t0):.0f}")
    bar.close()
    heads.eval()
    return {"train_seconds": round(time.time() - t0, 1), "train_steps": step + 1, "rows": len(feat),
            "row_samples_trained_on": seen, "final_loss_ema": round(ema or 0.0, 4),
            "final_train_agreement_ema": [round(a, 4) for a in (ema_acc.tolist() if ema_acc is not None else [])]}


@torch.no_grad()
def medusa_agreement(heads: MedusaHeads, examples: list[dict], top: int = 4) -> dict:
    """Per head: how often the target's greedy token at ``t + i + 1`` is the head's top-1 and
    within its top-``top`` (over the full vocabulary: a greedy token outside the head vocabulary
    is a miss). ``{"top1": [K], "top4": [K], "rows": [K]}``."""
    feat, _, _, valid, greedy = medusa_rows(examples, heads.num_heads, heads.token_ids, heads.vocab_size, 1)
    hit1 = torch.zeros(heads.num_heads)
    hitn = torch.zeros(heads.num_heads)
    for s in range(0, len(feat), 1024):
        logits = heads.reduced_logits(feat[s:s + 1024].float())  # [b, K, H]
        ranked = heads.token_ids[logits.topk(top, -1).indices]  # [b, K, top] full ids
        g, v = greedy[s:s + 1024], valid[s:s + 1024]
        hit1 += ((ranked[..., 0] == g) & v).sum(0)
        hitn += ((ranked == g[..., None]).any(-1) & v).sum(0)
    rows = valid.sum(0).clamp_min(1).float()
    return {"top1": [round(x, 4) for x in (hit1 / rows).tolist()],
            f"top{top}": [round(x, 4) for x in (hitn / rows).tolist()], "rows": valid.sum(0).tolist()}


def medusa_metrics(heads_dir: Path, target, heldout: dict[str, list[dict]], training: dict,
                   untrained: dict | None = None) -> dict:
    """The saved heads reloaded (bf16 on disk, fp32 here): ``metrics["medusa"]``."""
    loaded = load_medusa_heads(heads_dir, target, torch.float32)
    out = {"training": training, "num_heads": loaded.num_heads, "num_layers": loaded.num_layers,
           "head_vocab_size": len(loaded.token_ids),
           "trained_parameters": sum(q.numel() for q in loaded.parameters()),
           "bytes": sum(f.stat().st_size for f in Path(heads_dir).iterdir()),
           "note": "agreement: head i on the feature at t vs the target's greedy token at t+i+1, held out"}
    for name, exs in heldout.items():
        a = medusa_agreement(loaded, exs)
        out[f"agreement_{name}_heldout"] = {"top1": a["top1"], "top4": a["top4"]}
        out[f"heldout_rows_{name}"] = a["rows"]
        if untrained is not None:
            out[f"untrained_agreement_{name}_heldout"] = untrained[name]
    return out


def train_and_save(target, token_ids: torch.Tensor, train: list[dict], heldout: dict[str, list[dict]],
                   cfg: MedusaTrainConfig, out: Path, extra: dict | None = None) -> dict:
    """Initialise, train, save (bf16) and measure Medusa heads; the metrics."""
    heads = init_medusa_heads(target, token_ids, cfg)
    untrained = {name: medusa_agreement(heads, exs)["top1"] for name, exs in heldout.items()}
    training = train_medusa(heads, train, cfg)
    save_medusa_heads(heads, out, extra={"built_by": "specdec.demo.medusa", "seed": cfg.seed, **(extra or {})})
    return {"config": asdict(cfg), **medusa_metrics(out, target, heldout, training, untrained)}


# ----------------------------------------------------------------------------- a finished cache
@dataclass
class MedusaDataConfig:
    """Teacher data for ``add_medusa_heads`` (a full build reuses its own): the build's splits
    and held-out sets, fewer training prompts; the float32 target's greedy answers. Generation
    is the cost: only the ``n_chat_answered`` shortest of the ``n_chat_train`` prompts are
    answered (the order generation batches them in, so a stopped run's batches are reused)."""

    seed: int = 0
    n_chat_train: int = 384
    n_chat_answered: int | None = 128
    n_chat_heldout: int = 16  # the build's held-out prompts
    max_new_tokens: int = 128
    gen_batch: int = 32
    n_code_heads: int = 32
    code_head_new_tokens: int = 128
    n_code_chunks: int = 160
    n_code_eval_chunks: int = 12  # the build's held-out chunks
    topk: int = 8


def medusa_teacher(target, tok, cfg: MedusaDataConfig, work: Path | None = None):
    """(train examples, {"code": .., "chat": ..} held out) with features, from the demo corpus.
    Generation checkpoints each batch under ``work`` (resumable)."""
    b = BuildConfig(seed=cfg.seed, topk=cfg.topk, n_chat_train=cfg.n_chat_train, n_chat_heldout=cfg.n_chat_heldout,
                    max_new_tokens=cfg.max_new_tokens, gen_batch=cfg.gen_batch, n_code_heads=cfg.n_code_heads,
                    code_head_new_tokens=cfg.code_head_new_tokens, n_code_chunks=cfg.n_code_chunks,
                    n_code_eval_chunks=cfg.n_code_eval_chunks)
    train_files, held_files = split_files(stdlib_files(), b.seed, b.heldout_file_frac)
    train_prompts, held_prompts = chat_prompts(b.seed, b.n_chat_train, b.n_chat_heldout,
                                               function_snippets(train_files, b.seed))
    if cfg.n_chat_answered is not None:  # the shortest, in their own order
        lengths = [len(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for p in train_prompts]
        keep = set(sorted(range(len(train_prompts)), key=lambda i: lengths[i])[:cfg.n_chat_answered])
        train_prompts = [p for i, p in enumerate(train_prompts) if i in keep]
    sub = (lambda name: work / name) if work is not None else (lambda name: None)
    chat = generate_answers(target, tok, train_prompts, b, "target answers (train prompts)", sub("chat"))
    chat_eval = generate_answers(target, tok, held_prompts, b, "target answers (held-out prompts)", sub("chat_eval"))
    heads = file_heads(tok, train_files, b.n_code_heads, b.code_head_tokens, b.seed + 2)
    code_gen = continue_greedily(target, tok, heads, b, "target continuations (code heads)", sub("code_gen"),
                                 b.code_head_new_tokens)
    code = teacher_code(target, code_chunks(tok, train_files, b.n_code_chunks, b.code_chunk, b.seed), b,
                        "teacher log-probs (stdlib code)")
    code_eval = teacher_code(target, code_chunks(tok, held_files, b.n_code_eval_chunks, b.code_chunk, b.seed + 1), b,
                             "teacher log-probs (held-out code)")
    add_features(target, chat + chat_eval + code_gen, "target features")
    return chat + code_gen + code, {"code": code_eval, "chat": chat_eval}


def add_medusa_heads(root: Path, cfg: MedusaTrainConfig | None = None, data: MedusaDataConfig | None = None,
                     out: Path | None = None) -> dict:
    """Train Medusa heads for a finished demo cache ``root`` (its float32 target, the EAGLE
    head's vocabulary), write them to ``out`` (default ``root/medusa``; built in a temp dir,
    renamed into place) and record ``metrics["medusa"]`` in ``root/metrics.json`` (``out``'s
    parent's when ``out`` is given elsewhere)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.files import EAGLE_WEIGHTS

    root, cfg, data = Path(root), cfg or MedusaTrainConfig(), data or MedusaDataConfig()
    out = Path(out) if out is not None else root / "medusa"
    t0 = time.time()
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    token_ids = load_file(str(root / "eagle" / EAGLE_WEIGHTS))["token_ids"].long()  # the EAGLE head's
    work = out.parent / f".medusa.work-{data.seed}"
    train, heldout = medusa_teacher(target, tok, data, work)
    t_data = time.time() - t0
    tmp = out.parent / f".medusa.build-{os.getpid()}-{int(time.time())}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        metrics = train_and_save(target, token_ids, train, heldout, cfg, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    metrics["data"] = {**asdict(data), "seconds": round(t_data, 1),
                       "label_tokens": sum(len(e["pos"]) for e in train)}
    metrics["seconds"] = round(time.time() - t0, 1)
    metrics["torch_threads"] = torch.get_num_threads()
    file = (root if out.parent == root else out.parent) / "metrics.json"
    all_metrics = json.loads(file.read_text()) if file.is_file() else {}
    all_metrics["medusa"] = metrics
    staged = file.with_name(f".metrics.json.{os.getpid()}")
    staged.write_text(json.dumps(all_metrics, indent=2))
    os.replace(staged, file)
    return metrics


if __name__ == "__main__":  # python -m specdec.demo.medusa ROOT [OUT]: add heads to a finished cache
    m = add_medusa_heads(Path(sys.argv[1]), out=Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(json.dumps(m, indent=2))
