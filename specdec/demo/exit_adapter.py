"""How the demo builds the early-exit adapter (:mod:`specdec.models.exit_adapter`): initialise
it from the target, distil it, measure it. Phase 7 of the demo build, or added to a finished
demo cache on its own (``add_exit_adapters``).

``W_down`` starts at zero and ``norm_out`` / ``head`` start as copies of the target's final norm
and LM-head rows, so an untrained adapter IS the raw exit (on the reduced vocabulary); training
only moves away from it. The target is never written: features come from it under
``no_grad`` and every initial weight is a copy.

The build distils it like the demo draft: top-K teacher log-probs of the bf16 target on the
target's own chat answers and on stdlib code (``teacher.py`` and ``corpus.py``, the draft's
splits), features ``h_L`` taken from the same teacher pass, a fixed number of AdamW steps
(deterministic), and greedy top-1 agreement with the target on held-out code and chat for
every exit layer tried.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from tqdm.auto import tqdm

from specdec.drafters.early_exit import RawExit, ShallowStack
from specdec.models.draft import load_draft
from specdec.models.exit_adapter import ExitAdapter, save_exit_adapter
from specdec.models.files import DRAFT_WEIGHTS, EXIT_SUMMARY
from specdec.policy import best_k

from .config import BuildConfig
from .corpus import code_chunks, function_snippets, split_files, stdlib_files
from .evaluate import step_time
from .prompts import chat_prompts
from .teacher import generate_answers


def _output_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    stack = ShallowStack(model, 1)
    return stack.final_norm, stack.lm_head


def adapter_from_target(model: nn.Module, exit_layer: int, token_ids: torch.Tensor | None = None,
                        intermediate_size: int | None = None, seed: int = 0) -> ExitAdapter:
    """A float32 adapter equal to the raw exit at ``exit_layer``, from COPIES of target weights."""
    cfg = model.config
    final_norm, lm_head = _output_modules(model)
    kind = "rms" if not isinstance(final_norm, nn.LayerNorm) else "layer"
    eps = getattr(final_norm, "variance_epsilon", getattr(final_norm, "eps", 1e-5))
    if token_ids is None:
        token_ids = torch.arange(cfg.vocab_size)
    torch.manual_seed(seed)
    adapter = ExitAdapter(cfg.hidden_size, intermediate_size or 4 * cfg.hidden_size, cfg.vocab_size,
                          token_ids, exit_layer, kind, float(eps))
    with torch.no_grad():
        nn.init.normal_(adapter.gate.weight, std=0.02)
        nn.init.normal_(adapter.up.weight, std=0.02)
        nn.init.zeros_(adapter.down.weight)  # identity block: the untrained adapter is the raw exit
        adapter.norm_out.weight.copy_(final_norm.weight.detach().float())
        if kind == "layer":
            adapter.norm_out.bias.copy_(final_norm.bias.detach().float())
        adapter.head.weight.copy_(lm_head.weight.detach()[token_ids.to(lm_head.weight.device)].float())
    return adapter.float()


# ----------------------------------------------------------------------------- features
@torch.no_grad()
def exit_features(model: nn.Module, sequences: list[dict], layers: list[int], topk: int = 32,
                  desc: str = "exit features") -> dict:
    """One teacher pass per sequence: ``h_L`` for each exit layer and the target's top-K.

    sequences: [{"ids": [n] long, "pos": [m] long}] - the rows at ``pos`` predict the next token.
    Returns {"h": {L: [N, d] bfloat16}, "top_i": [N, K] int32, "top_v": [N, K] float16 log-probs}.
    """
    hs: dict[int, list[torch.Tensor]] = {L: [] for L in layers}
    ti, tv = [], []
    for seq in tqdm(sequences, desc=desc, unit="seq", disable=len(sequences) < 20):
        out = model(input_ids=seq["ids"][None], output_hidden_states=True, use_cache=False)
        pos = seq["pos"]
        for L in layers:
            hs[L].append(out.hidden_states[L][0, pos].to(torch.bfloat16))
        v, i = torch.log_softmax(out.logits[0, pos].float(), -1).topk(topk, -1)
        ti.append(i.to(torch.int32))
        tv.append(v.to(torch.float16))
    return {"h": {L: torch.cat(x) for L, x in hs.items()}, "top_i": torch.cat(ti), "top_v": torch.cat(tv)}


# ----------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    steps: int = 300
    batch: int = 1024  # positions per step
    lr: float = 1e-3
    warmup: int = 20
    seed: int = 0


def _soft_targets(top_i: torch.Tensor, top_v: torch.Tensor, full2head: torch.Tensor):
    """Teacher top-K restricted to the head vocabulary, renormalised: (head columns, probs)."""
    hi = full2head[top_i.long()]  # -1 outside the head vocabulary
    p = top_v.float().exp() * (hi >= 0)
    return hi.clamp_min(0), p / p.sum(-1, keepdim=True).clamp_min(1e-6)


def train_exit_adapter(adapter: ExitAdapter, feats: torch.Tensor, top_i: torch.Tensor, top_v: torch.Tensor,
                       cfg: TrainConfig, desc: str = "exit adapter") -> dict:
    """Distil: cross-entropy to the target's top-K (on the head vocabulary). Fixed steps, seeded.

    feats [N, d] (h_L of the training positions), top_i / top_v [N, K]. Only ``adapter``
    changes: the features were computed without gradients, the initial weights were copies.
    """
    full2head = torch.full((adapter.vocab_size,), -1, dtype=torch.long)
    full2head[adapter.token_ids] = torch.arange(len(adapter.token_ids))
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    adapter.train()
    t0, ema, ema_acc = time.time(), None, None
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=cfg.steps < 50)
    for step in bar:
        idx = torch.randint(0, feats.shape[0], (min(cfg.batch, feats.shape[0]),), generator=gen)
        cols, p = _soft_targets(top_i[idx], top_v[idx], full2head)
        warm, cos = min(1.0, (step + 1) / cfg.warmup), 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:  # warmup, then cosine down to 10 %
            g["lr"] = cfg.lr * warm * (0.1 + 0.9 * cos)
        logits = adapter.reduced_logits(feats[idx].float())
        loss = -(p * torch.log_softmax(logits, -1).gather(-1, cols)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        opt.step()
        acc = (logits.argmax(-1) == cols[:, 0]).float().mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        bar.set_postfix(loss=f"{ema:.3f}", agree=f"{ema_acc:.3f}")
    adapter.eval()
    return {"train_seconds": round(time.time() - t0, 1), "steps": cfg.steps, "batch": cfg.batch,
            "final_loss_ema": round(ema, 4) if ema is not None else None,
            "final_train_agreement_ema": round(ema_acc, 4) if ema_acc is not None else None}


@torch.no_grad()
def agreement(head, feats: torch.Tensor, top1: torch.Tensor, chunk: int = 2048) -> float:
    """Greedy top-1 agreement of ``head(h_L)`` with the target's greedy token."""
    hit = 0
    for s in range(0, feats.shape[0], chunk):
        pred = head(feats[s:s + chunk].to(next(head.parameters()).dtype)).argmax(-1)
        hit += (pred == top1[s:s + chunk].long()).sum().item()
    return hit / max(1, feats.shape[0])


# ----------------------------------------------------------------------------- demo build
@dataclass
class ExitBuildConfig:
    seed: int = 0
    exit_layers: tuple = (8,)  # of SmolLM2's 30; a raw exit agrees 3 % (8) .. 34 % (24)
    intermediate_size: int = 1536  # the target's own MLP width: ~1/30 of a target step
    topk: int = 32
    steps: int = 300  # fixed: deterministic; ~1.5 min per layer on one busy core
    batch: int = 512  # positions per step: 150k position-samples, ~3 epochs of the add path's data
    lr: float = 1e-3
    # Teacher data, only when an existing demo cache gets the adapter added (a full build
    # reuses its own). Held-out sizes match the demo build's, so the sets are the draft's.
    n_chat_train: int = 48
    n_chat_heldout: int = 16
    max_new_tokens: int = 144
    n_code_chunks: int = 120
    n_code_eval_chunks: int = 12


def _say(msg: str) -> None:
    tqdm.write(f"[specdec demo] {msg}", file=sys.stderr)


def demo_teacher_sequences(target, tok, cfg: ExitBuildConfig) -> tuple[list[dict], dict[str, list[dict]]]:
    """Training and held-out sequences from the demo corpus (the build's helpers and splits)."""
    b = BuildConfig(seed=cfg.seed, topk=cfg.topk, n_chat_train=cfg.n_chat_train, n_chat_heldout=cfg.n_chat_heldout,
                    max_new_tokens=cfg.max_new_tokens, n_code_chunks=cfg.n_code_chunks,
                    n_code_eval_chunks=cfg.n_code_eval_chunks)
    train_files, held_files = split_files(stdlib_files(), b.seed, b.heldout_file_frac)
    train_prompts, held_prompts = chat_prompts(b.seed, b.n_chat_train, b.n_chat_heldout,
                                               function_snippets(train_files, b.seed))
    chat = generate_answers(target, tok, train_prompts, b, "target answers (train prompts)")
    chat_eval = generate_answers(target, tok, held_prompts, b, "target answers (held-out prompts)")

    def code(files, n, seed):
        return [{"ids": torch.tensor(c), "pos": torch.arange(len(c) - 1)}
                for c in code_chunks(tok, files, n, b.code_chunk, seed)]

    return chat + code(train_files, b.n_code_chunks, b.seed), {
        "code": code(held_files, b.n_code_eval_chunks, b.seed + 1), "chat": chat_eval}


class _ExitStep(nn.Module):
    """One draft step (shallow layers + exit head) behind a causal-LM call, for ``step_time``."""

    def __init__(self, stack, head):
        super().__init__()
        self.stack, self.head = stack, head
        self.dtype = next(head.parameters()).dtype

    def forward(self, input_ids, past_key_values, use_cache=True):
        h = self.stack.hidden(input_ids, past_key_values)[0, -1:]
        return SimpleNamespace(logits=self.head(h.to(self.dtype))[None])


def _state_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _draft_agreement(draft_dir: Path, seqs: list[dict], top1: torch.Tensor) -> float:
    draft, hit, off = load_draft(draft_dir, torch.float32), 0, 0
    with torch.no_grad():
        for s in seqs:
            n = len(s["pos"])
            pred = draft(input_ids=s["ids"][None], use_cache=False).logits[0, s["pos"]].argmax(-1)
            hit += (pred == top1[off:off + n].long()).sum().item()
            off += n
    return hit / max(1, off)


def build_exit_adapters(out: Path, target, token_ids: torch.Tensor | None, train: list[dict],
                        heldout: dict[str, list[dict]], cfg: ExitBuildConfig, draft_dir: Path | None = None) -> dict:
    """Train one adapter per exit layer into ``out/layer{L}``; metrics into ``out/exit.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start, before = time.time(), _state_hash(target)
    layers = list(cfg.exit_layers)
    feats = exit_features(target, train, layers, cfg.topk, "exit features (train)")
    evals = {name: exit_features(target, seqs, layers, cfg.topk, f"exit features (held-out {name})")
             for name, seqs in heldout.items()}
    vocab = min(8000, target.config.vocab_size)
    t_target = step_time(target, vocab=vocab)
    metrics: dict = {"config": asdict(cfg), "train_positions": int(feats["top_i"].shape[0]),
                     "heldout_positions": {n: int(f["top_i"].shape[0]) for n, f in evals.items()},
                     "target_step_ms": round(t_target * 1e3, 2), "layers": {}}
    if draft_dir is not None:  # the demo draft on the very same held-out positions, to compare
        metrics["draft_agreement"] = {n: round(_draft_agreement(draft_dir, heldout[n], f["top_i"][:, 0]), 4)
                                      for n, f in evals.items()}
    for L in layers:
        _say(f"exit layer {L}: distilling the adapter")
        raw = RawExit(ShallowStack(target, L))
        adapter = adapter_from_target(target, L, token_ids, cfg.intermediate_size, cfg.seed)
        m: dict = {"raw_exit_agreement": {n: round(agreement(raw, f["h"][L], f["top_i"][:, 0]), 4)
                                          for n, f in evals.items()},
                   "raw_exit_reduced_head_agreement": {n: round(agreement(adapter, f["h"][L], f["top_i"][:, 0]), 4)
                                                       for n, f in evals.items()}}
        m["training"] = train_exit_adapter(adapter, feats["h"][L], feats["top_i"], feats["top_v"],
                                           TrainConfig(cfg.steps, cfg.batch, cfg.lr, seed=cfg.seed + L),
                                           desc=f"exit adapter (layer {L})")
        m["agreement"] = {n: round(agreement(adapter, f["h"][L], f["top_i"][:, 0]), 4) for n, f in evals.items()}
        save_exit_adapter(adapter, out / f"layer{L}", target.config, extra={"built_by": "specdec.demo.exit_adapter",
                                                                             "seed": cfg.seed})
        stack = ShallowStack(target, L)
        steps = {"raw_full_head": step_time(_ExitStep(stack, raw), vocab=vocab),
                 "adapter_fp32": step_time(_ExitStep(stack, adapter), vocab=vocab),
                 "adapter_bf16": step_time(_ExitStep(stack, copy.deepcopy(adapter).to(torch.bfloat16)), vocab=vocab)}
        m["draft_step_ms"] = {k: round(v * 1e3, 2) for k, v in steps.items()}
        c = min(steps["adapter_fp32"], steps["adapter_bf16"]) / t_target
        a = sum(m["agreement"].values()) / len(m["agreement"])
        k, s = best_k(a, c, lambda k: 1 + 0.02 * k, 8)  # v(k): the design notes' measured slope
        m.update(c=round(c, 4), c_raw_full_head=round(steps["raw_full_head"] / t_target, 4),
                 expected_speedup={"a": round(a, 4), "best_k": k, "S": round(s, 3)})
        metrics["layers"][str(L)] = m
    metrics["best_layer"] = max(layers, key=lambda L: metrics["layers"][str(L)]["expected_speedup"]["S"])
    metrics["target_unchanged"] = _state_hash(target) == before
    if not metrics["target_unchanged"]:
        raise RuntimeError("building the exit adapters changed the target's weights")
    metrics["seconds"] = round(time.time() - t_start, 1)
    (out / EXIT_SUMMARY).write_text(json.dumps(metrics, indent=2))  # last: the build is complete
    return metrics


def add_exit_adapters(root: Path, cfg: ExitBuildConfig | None = None) -> dict:
    """Add ``exit/`` to a finished demo cache (target and draft untouched) and record its
    metrics under ``"early_exit"`` in ``metrics.json``. Built in a temp dir, renamed into place."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, cfg = Path(root), cfg or ExitBuildConfig()
    torch.manual_seed(cfg.seed)
    _say(f"adding early-exit adapters (layers {list(cfg.exit_layers)}) to {root}")
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    token_ids = load_file(str(root / "draft" / DRAFT_WEIGHTS))["token_ids"].long()  # the draft's head
    train, heldout = demo_teacher_sequences(target, tok, cfg)
    tmp = root / f".exit.build-{os.getpid()}-{int(time.time())}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        metrics = build_exit_adapters(tmp, target, token_ids, train, heldout, cfg, draft_dir=root / "draft")
        if (root / "exit").exists():
            shutil.rmtree(root / "exit")
        tmp.rename(root / "exit")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    all_metrics = json.loads((root / "metrics.json").read_text())
    all_metrics["early_exit"] = metrics
    staged = root / f".metrics.json.{os.getpid()}"
    staged.write_text(json.dumps(all_metrics, indent=2))
    os.replace(staged, root / "metrics.json")
    return metrics
