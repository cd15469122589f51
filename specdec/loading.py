"""Loading models and tokenizers: hub ids or local paths, in eval mode, on a device."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.hardware import HALF_WEIGHTS, resolve_device, resolve_dtype
from specdec.models.draft import load_draft
from specdec.models.files import DRAFT_MARKER
from specdec.models.packed import PackedLinear, pack_linears

# a dtype's name -> the dtype of its activations (HALF_WEIGHTS: float32, on float16 weights)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, HALF_WEIGHTS: torch.float32}


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", *, revision: str | None = None,
               trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a causal LM from a local path or a hub id (at ``revision``), in eval mode, on ``device``,
    in ``dtype`` (``auto``: the fastest there, ``specdec.hardware.resolve_dtype``), its linear
    layers packed for the CPU's matrix-product library where it has one (``HALF_WEIGHTS``: on
    float16 weights; a CPU format)."""
    name = resolve_dtype(dtype, device)
    if name == HALF_WEIGHTS and resolve_device(device) != "cpu":
        raise ValueError(f"dtype {HALF_WEIGHTS} is a CPU format; on {resolve_device(device)} serve float16 or bfloat16")
    torch_dtype = DTYPES[name]
    # A project-built draft (reduced output vocabulary) carries this marker and its own loader.
    if (Path(name_or_path) / DRAFT_MARKER).exists():
        model = load_draft(name_or_path, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=torch_dtype, revision=revision, trust_remote_code=trust_remote_code
        )
    model = model.to(resolve_device(device)).eval()
    pack_linears(model, half=name == HALF_WEIGHTS)  # on a CPU: products on prepacked weights (``specdec.models.packed``)
    return model


def dtype_name(model: torch.nn.Module) -> str:
    """The dtype a loaded model is served in, by ``load_model``'s names."""
    if any(isinstance(m, PackedLinear) and m.half for m in model.modules()):
        return HALF_WEIGHTS
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def model_max_length(config) -> int | None:
    """The longest sequence a model's positions allow (Llama-style or GPT-2 configs)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_tokenizer(name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)


def check_same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """Refuse a pair whose tokenizers map text to different ids."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(
            "draft and target tokenizers differ: speculative decoding needs a draft with the "
            f"target's vocabulary (target has {len(target_tokenizer)} tokens, draft has "
            f"{len(draft_tokenizer)})"
        )


def load_weights(file) -> dict:
    """A checkpoint's tensors: safetensors, or a torch pickle loaded with ``weights_only``."""
    file = Path(file)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(file, map_location="cpu", weights_only=True)
