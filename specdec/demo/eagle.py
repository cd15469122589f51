"""Training an EAGLE head on the frozen target (the demo build's EAGLE phase; tests use it on
tiny models). The head's definition and file format are :mod:`specdec.models.eagle`.

Data: teacher examples (``specdec.demo.teacher``) with the target's features ``feat``
[n, d] at every position and its top-K log-probs at the label positions ``pos``.

Loss, as in EAGLE: entry ``i`` sees ``(f_i + noise, x_{i+1})`` and predicts ``f_{i+1}``:

- distillation: cross-entropy of the head's logits at entry ``i`` against the target's top-K
  distribution at position ``i + 1`` (restricted to the head vocabulary, renormalised);
- feature regression: smooth L1 between the prediction and ``f_{i+1}`` (in units of the
  features' RMS), weighted by ``reg_weight``: chain drafting feeds predictions back in;
- noise on the input features (``noise`` x their RMS), so a prediction fed back in is in
  distribution;
- training-time test (EAGLE-3, Li et al. 2025), ``ttt_steps`` > 1: the head is unrolled on its
  own predictions. Step 1 is the above; at step ``j`` entry ``i`` sees the head's step-(j-1)
  prediction of ``f_i`` (made at entry ``i - 1``; entry 0 keeps ``f_0``), exactly what
  ``eagle_agreement(depth=j)`` evaluates, and step ``j``'s loss is weighted ``ttt_decay**(j-1)``
  (the weights sum to 1). Gradients flow through the unroll unless ``ttt_detach``.

Only the head's own parameters train: the target's embedding and LM-head rows are read, not
copied into the optimiser (the build hashes the target's weights before and after).
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.models.eagle import EagleHead, eagle_config


@dataclass
class EagleTrainConfig:
    seed: int = 0
    steps: int = 2400
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup: int = 50
    reg_weight: float = 1.0
    noise: float = 0.05
    intermediate_size: int | None = None  # the head layer's MLP width; None: the target's
    ttt_steps: int = 1  # 1: EAGLE-1 training; > 1: EAGLE-3's training-time test (the demo uses 3)
    ttt_decay: float = 0.8
    ttt_detach: bool = False  # feed the unroll detached predictions (no gradient through them)
    budget_s: float | None = None  # a wall-clock cap (breaks determinism when it binds)


def init_eagle_head(target, token_ids: torch.Tensor, cfg: EagleTrainConfig) -> EagleHead:
    """A fresh float32 head for ``target`` over the vocabulary ``token_ids`` (seeded)."""
    torch.manual_seed(cfg.seed)
    head = EagleHead(eagle_config(target.config, intermediate_size=cfg.intermediate_size), len(token_ids)).float()
    head.token_ids = token_ids.clone().long()
    return head.bind_target(target)


def _batches(examples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    out, cur = [], []
    for i in order:
        if cur and len(examples[i]["ids"]) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _collate(examples: list[dict], idx: list[int], full2head: torch.Tensor):
    """Right-padded ids / features and the flattened (row, entry) label positions."""
    L = max(len(examples[i]["ids"]) for i in idx)
    d = examples[idx[0]]["feat"].shape[-1]
    ids = torch.zeros((len(idx), L), dtype=torch.long)
    feat = torch.zeros((len(idx), L, d))
    valid = torch.zeros((len(idx), L - 1), dtype=torch.bool)  # entry i has a true f_{i+1}
    rows, entries, ti, tv = [], [], [], []
    for r, i in enumerate(idx):
        ex = examples[i]
        n = len(ex["ids"])
        ids[r, :n], feat[r, :n], valid[r, :n - 1] = ex["ids"], ex["feat"].float(), True
        use = ex["pos"] >= 1  # entry pos-1 predicts the distribution at position pos
        rows.append(torch.full((int(use.sum()),), r, dtype=torch.long))
        entries.append(ex["pos"][use] - 1)
        ti.append(ex["top_i"][use].long())
        tv.append(ex["top_v"][use].float())
    ti = torch.cat(ti)
    hi = full2head[ti]  # -1 outside the head vocabulary
    p = torch.cat(tv).exp() * (hi >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    return ids, feat, valid, torch.cat(rows), torch.cat(entries), hi.clamp_min(0), p


def _full2head(head: EagleHead) -> torch.Tensor:
    full2head = torch.full((head.vocab_size,), -1, dtype=torch.long)
    full2head[head.token_ids] = torch.arange(len(head.token_ids))
    return full2head


def feature_scale(examples: list[dict]) -> float:
    """The RMS of the target's features (over a sample of the examples)."""
    sample = torch.cat([ex["feat"].float() for ex in examples[:: max(1, len(examples) // 64)]])
    return float(sample.pow(2).mean().sqrt())


def _unroll(head: EagleHead, feat: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, pred: torch.Tensor,
            detach: bool = False) -> torch.Tensor:
    """One more draft depth: entry ``i`` sees the previous depth's prediction of ``f_i``."""
    prev = pred.detach() if detach else pred
    return head(torch.cat([feat[:, :1], prev[:, :-1]], 1), ids, positions)


def head_loss(head: EagleHead, batch, scale: float, cfg: EagleTrainConfig, generator: torch.Generator):
    """(loss, top-1 agreement at depth 1) of one collated batch, over ``cfg.ttt_steps`` depths."""
    ids, feat, valid, rows, entries, hi, p = batch
    noisy = feat[:, :-1] + torch.randn(feat[:, :-1].shape, generator=generator) * (cfg.noise * scale)
    positions = torch.arange(ids.shape[1] - 1)[None].expand(ids.shape[0], -1)
    steps = max(1, cfg.ttt_steps)
    weights = [cfg.ttt_decay ** j for j in range(steps)]
    total, loss, agree = sum(weights), 0.0, 0.0
    pred = None
    for j, w in enumerate(weights):
        # [B, L-1, d]; causal (right padding is harmless)
        pred = head(noisy, ids[:, 1:], positions) if j == 0 else _unroll(head, noisy, ids[:, 1:], positions, pred,
                                                                           cfg.ttt_detach)
        reg = F.smooth_l1_loss(pred[valid] / scale, feat[:, 1:][valid] / scale)
        use = entries >= j  # entry e at depth j+1 rests on the true f_{e-j}
        logits = head.reduced_logits(pred[rows[use], entries[use]])  # [N, H]
        ce = -(p[use] * torch.log_softmax(logits, -1).gather(-1, hi[use])).sum(-1).mean()
        loss = loss + (w / total) * (ce + cfg.reg_weight * reg)
        if j == 0:
            agree = (logits.argmax(-1) == hi[use][:, 0]).float().mean().item()
    return loss, agree


def train_eagle(head: EagleHead, examples: list[dict], cfg: EagleTrainConfig, desc: str = "training EAGLE head",
                checkpoint: Path | None = None, every: int = 20) -> dict:
    """Train ``head`` in place (float32, AdamW, warmup + cosine); deterministic given the seed.

    ``checkpoint``: a file where the whole training state (head, optimiser, random streams,
    batch queue) is saved every ``every`` steps and found again, so a restarted run resumes
    and ends where an uninterrupted one would."""
    torch.manual_seed(cfg.seed)
    rng, gen = random.Random(cfg.seed + 23), torch.Generator().manual_seed(cfg.seed + 29)
    full2head, scale = _full2head(head), feature_scale(examples)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    head.train()
    t0, ntok, ema, ema_acc, queue, step, start, spent = time.time(), 0, None, None, [], 0, 0, 0.0
    if checkpoint is not None and Path(checkpoint).is_file():
        st = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(st["head"]), opt.load_state_dict(st["opt"])
        rng.setstate(st["rng"]), gen.set_state(st["gen"]), torch.set_rng_state(st["torch"])
        start, ntok, ema, ema_acc, queue, spent = st["step"], st["ntok"], st["ema"], st["ema_acc"], st["queue"], st["spent"]
        t0 -= spent
    bar = tqdm(range(start, cfg.steps), desc=desc, unit="step", file=sys.stderr, initial=start, total=cfg.steps)
    for step in bar:
        if checkpoint is not None and step > start and step % every == 0:
            _save_state(checkpoint, {"head": head.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(),
                                     "gen": gen.get_state(), "torch": torch.get_rng_state(), "step": step,
                                     "ntok": ntok, "ema": ema, "ema_acc": ema_acc, "queue": queue,
                                     "spent": time.time() - t0})
        if cfg.budget_s is not None and time.time() - t0 > cfg.budget_s:
            tqdm.write(f"[specdec demo] EAGLE training budget reached after {step} steps", file=sys.stderr)
            break
        queue = queue or _batches(examples, cfg.batch_tokens, rng)
        batch = _collate(examples, queue.pop(), full2head)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        loss, acc = head_loss(head, batch, scale, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ntok += len(batch[3])
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        bar.set_postfix(loss=f"{ema:.3f}", agree=f"{ema_acc:.3f}", tok_s=f"{ntok / (time.time() - t0):.0f}")
    bar.close()
    head.eval()
    return {"train_seconds": round(time.time() - t0, 1), "train_steps": step + 1, "label_tokens_trained_on": ntok,
            "final_loss_ema": round(ema or 0.0, 4), "final_train_agreement_ema": round(ema_acc or 0.0, 4),
            "feature_rms": round(scale, 4)}


def _save_state(path: Path, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


@torch.no_grad()
def eagle_agreement(head: EagleHead, examples: list[dict], depth: int = 1) -> float:
    """Greedy top-1 agreement with the target at each label position: depth 1 drafts from true
    features (a round's first draft); depth ``j`` > 1 feeds entry ``i`` the head's own depth
    ``j-1`` prediction of ``f_i`` (made at entry ``i-1``: a round's j-th draft, as chain drafting
    does; the positions before it see predictions too)."""
    hit = tot = 0
    for ex in examples:
        ids, feat = ex["ids"][None], ex["feat"].float()[None]
        positions = torch.arange(ids.shape[1] - 1)[None]
        pred = head(feat[:, :-1], ids[:, 1:], positions)
        for _ in range(depth - 1):
            pred = _unroll(head, feat, ids[:, 1:], positions, pred)
        use = ex["pos"] >= depth
        logits = head.logits(pred[0, ex["pos"][use] - 1])
        hit += (logits.argmax(-1) == ex["top_i"][use][:, 0].long()).sum().item()
        tot += int(use.sum())
    return hit / max(1, tot)
