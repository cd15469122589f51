"""The EAGLE head: a one-layer draft that reads the TARGET's own features.

EAGLE (Li et al., 2024) drafts at the feature level. Entry ``i`` of the head's sequence takes
the target's final hidden state ``f_i`` at position ``i`` (what the target's LM head reads,
after its final norm) and the embedding of token ``x_{i+1}``, runs one decoder layer over its
own KV cache, and predicts the feature ``f_{i+1}``; the LM head on that prediction gives the
distribution of ``x_{i+2}``. Chain drafting feeds the prediction and the drafted token back in.

Worked example (context ``x0 x1 x2``; the target has fed ``x0 x1``, so ``f0 f1`` are known)::

    entry 0: (f0, x1)  ->  f1^            (cached; f1^ is not used: f1 is known)
    entry 1: (f1, x2)  ->  f2^ -> d1      (the first draft token)
    entry 2: (f2^, d1) ->  f3^ -> d2      (chain: the head's own prediction as input)

After verification the target's features of the accepted positions replace the predictions:
entries built on a prediction (entry 2 above) are rolled back and fed again with true features.

Parts (``EagleHead``): ``fc`` ([2d] -> [d], the embedding and the feature side by side), one
Llama decoder layer (``input_norm=False`` drops its input norm, as EAGLE-1's checkpoints do),
an optional output norm, and a reduced-vocabulary head: rows ``token_ids`` of the target's own
LM head (frozen, never stored with the head). The embedding is the target's too. Logits over
the full vocabulary are ``-inf`` outside ``token_ids``, so the draft's ``q`` stays exact.

On-disk format (a directory): ``specdec_eagle.json`` (marker + config, written last) and
``eagle.safetensors`` (``fc.*``, ``layer.*``, ``norm.*``, the ``token_ids`` buffer [H] int64).
EAGLE-1's released layout (``config.json`` + ``fc.*`` / ``layers.0.*`` weights, full-vocabulary
head) loads too: ``load_eagle_head`` recognises it.

How the demo trains a head is :mod:`specdec.demo.eagle`; how it drafts in the step loop is
:mod:`specdec.drafters.eagle`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.loading import load_weights
from specdec.models.files import EAGLE_FORMAT, EAGLE_MARKER, EAGLE_VERSION, EAGLE_WEIGHTS
from specdec.models.packed import PackedRows, pack_linears


def final_norm(model: nn.Module) -> nn.Module:
    """The module whose output is the target's feature: its final norm (Llama-style, GPT-2)."""
    if hasattr(model, "model") and hasattr(model.model, "norm"):
        return model.model.norm
    if hasattr(model, "transformer") and hasattr(model.transformer, "ln_f"):
        return model.transformer.ln_f
    raise ValueError(f"EAGLE supports Llama-style and GPT-2 targets, not {type(model).__name__}")


def eagle_config(target_config, *, intermediate_size: int | None = None) -> LlamaConfig:
    """The head layer's config: the target's width and heads (a GPT-2 target's too)."""
    d = target_config.to_dict()
    hidden = d.get("hidden_size") or d["n_embd"]
    heads = d.get("num_attention_heads") or d["n_head"]
    kv_heads = d.get("num_key_value_heads") or heads
    cfg = LlamaConfig(
        vocab_size=d["vocab_size"], hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=d.get("head_dim") or hidden // heads, num_hidden_layers=1,
        intermediate_size=intermediate_size or d.get("intermediate_size") or 4 * hidden,
        rms_norm_eps=d.get("rms_norm_eps") or d.get("layer_norm_epsilon") or 1e-5,
        max_position_embeddings=d.get("max_position_embeddings") or d.get("n_positions") or 2048,
        rope_parameters=d.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0},
    )
    return cfg


class EagleHead(nn.Module):
    """``forward(features [1, T, d], input_ids [1, T], position_ids [1, T], cache) -> [1, T, d]``
    predicted features; ``logits(features) -> [.., V]`` float32 over the full vocabulary."""

    def __init__(self, config: LlamaConfig, head_vocab_size: int, *, input_norm: bool = True,
                 output_norm: bool = True, fc_bias: bool = True):
        super().__init__()
        d = config.hidden_size
        # SDPA: causal when no mask is given (training, one sequence); the step loop's drafter
        # switches the head to the ragged pool attention, which falls back to SDPA when unbound.
        config._attn_implementation = "sdpa"
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        if not input_norm:
            self.layer.input_layernorm = nn.Identity()
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps) if output_norm else nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("token_ids", torch.arange(head_vocab_size, dtype=torch.long))
        self.register_buffer("head_weight", torch.zeros(head_vocab_size, d), persistent=False)
        self._embed: tuple[nn.Module] | None = None  # the target's, not a submodule: never saved
        self.rows = PackedRows()  # the product with ``head_weight``: packed, as the layers' are
        self.input_norm, self.output_norm = input_norm, output_norm

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def bind_target(self, target: nn.Module) -> "EagleHead":
        """Read the target's embedding and its LM head rows ``token_ids`` (copies nothing else)."""
        emb, out = target.get_input_embeddings(), target.get_output_embeddings()
        if emb.weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"the head is {self.config.hidden_size} wide, the target {emb.weight.shape[1]}")
        if int(self.token_ids.max()) >= out.weight.shape[0]:
            raise ValueError("the head's vocabulary does not fit the target's")
        self._embed = (emb,)
        full = len(self.token_ids) == out.weight.shape[0] and torch.equal(
            self.token_ids.cpu(), torch.arange(len(self.token_ids)))
        with torch.no_grad():
            rows = out.weight.detach() if full else out.weight[self.token_ids].detach()  # full: shared, no copy
            self.head_weight = rows if rows.dtype == self.fc.weight.dtype else rows.to(self.fc.weight.dtype)
        return self

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self._embed is not None, "bind_target first"
        return self._embed[0](input_ids).to(self.fc.weight.dtype)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask=None, cache=None) -> torch.Tensor:
        assert features.shape[:2] == input_ids.shape, (features.shape, input_ids.shape)
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.fc.weight.dtype)], -1))
        rope = self.rotary(x, position_ids=position_ids)
        h = self.layer(x, attention_mask=attention_mask, position_embeddings=rope, position_ids=position_ids,
                       cache=cache, use_cache=cache is not None)
        return self.norm(h)

    def reduced_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[.., H]: column j scores token ``token_ids[j]``."""
        return self.rows(features.to(self.head_weight.dtype), self.head_weight)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        small = self.reduced_logits(features).float()
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_ids, small)


def save_eagle_head(head: EagleHead, path: Path, extra: dict | None = None, dtype=torch.bfloat16) -> None:
    """Write the head directory (marker last); weights in ``dtype`` except ``token_ids``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: (v if k == "token_ids" else v.to(dtype)).contiguous() for k, v in head.state_dict().items()
          if "rotary" not in k}
    save_file(sd, str(path / EAGLE_WEIGHTS))
    meta = {"format": EAGLE_FORMAT, "version": EAGLE_VERSION, "llama_config": head.config.to_dict(),
            "head_vocab_size": len(head.token_ids), "input_norm": head.input_norm, "output_norm": head.output_norm,
            "fc_bias": head.fc.bias is not None, "weights": EAGLE_WEIGHTS, **(extra or {})}
    (path / EAGLE_MARKER).write_text(json.dumps(meta, indent=2, default=str))


def is_eagle_dir(path) -> bool:
    path = Path(path)
    return (path / EAGLE_MARKER).is_file() or _is_eagle1_dir(path)


def load_eagle_head(path, target: nn.Module, dtype: torch.dtype = torch.float32, half: bool = False) -> EagleHead:
    """A head directory (ours or EAGLE-1's released layout; a Hugging Face repo id is
    downloaded first), bound to ``target``, in eval mode; ``half``: its products on fp16 weights
    (``specdec.models.packed``), as a ``float16-weights`` target's are."""
    path = Path(path)
    if not path.exists() and "/" in str(path) and not str(path).startswith(("/", ".")):
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path)))
    if (path / EAGLE_MARKER).is_file():
        meta = json.loads((path / EAGLE_MARKER).read_text())
        if meta.get("format") != EAGLE_FORMAT:
            raise ValueError(f"{path / EAGLE_MARKER} is not a specdec EAGLE head marker")
        cfg_d = {k: v for k, v in meta["llama_config"].items() if k != "transformers_version"}
        head = EagleHead(LlamaConfig(**cfg_d), int(meta["head_vocab_size"]), input_norm=meta["input_norm"],
                         output_norm=meta["output_norm"], fc_bias=meta.get("fc_bias", True))
        sd = load_weights(path / meta.get("weights", EAGLE_WEIGHTS))
    elif _is_eagle1_dir(path):
        head, sd = _eagle1(path, target)
    else:
        raise FileNotFoundError(f"{path} holds no EAGLE head ({EAGLE_MARKER}, or EAGLE-1's config.json + weights)")
    sd = {k: (v.long() if k == "token_ids" else v.to(dtype)) for k, v in sd.items()}
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k and k != "head_weight"]
    if missing or unexpected:
        raise ValueError(f"EAGLE head weights mismatch: missing={missing} unexpected={unexpected}")
    if head.vocab_size != target.config.vocab_size:
        raise ValueError(f"the head was made for a vocabulary of {head.vocab_size}, the target has "
                         f"{target.config.vocab_size}")
    head = head.to(dtype=dtype, device=next(target.parameters()).device)
    head = head.bind_target(target).eval()
    pack_linears(head, half=half)
    head.rows.half = half
    return head


# EAGLE-1's released checkpoints (e.g. yuhuili/EAGLE-llama2-chat-7B): a LlamaConfig with one
# layer, and weights ``fc.weight`` / ``fc.bias`` / ``layers.0.*`` (no input norm in that layer,
# no output norm: the prediction goes straight to the target's full LM head).
_EAGLE1_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def _is_eagle1_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / f).is_file() for f in _EAGLE1_WEIGHTS)


def _eagle1(path: Path, target: nn.Module) -> tuple[EagleHead, dict]:
    file = next(path / f for f in _EAGLE1_WEIGHTS if (path / f).is_file())
    raw = load_weights(file)
    if "fc.weight" not in raw:
        raise ValueError(f"{file} has no fc.weight: not an EAGLE-1 head")
    cfg_d = json.loads((path / "config.json").read_text())
    cfg_d = {k: v for k, v in cfg_d.items() if k not in ("architectures", "transformers_version")}
    cfg = LlamaConfig(**{**cfg_d, "num_hidden_layers": 1})
    sd = {("layer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in raw.items()
          if k.startswith(("fc.", "layers.0."))}
    head = EagleHead(cfg, target.config.vocab_size, input_norm="layer.input_layernorm.weight" in sd,
                     output_norm=False, fc_bias="fc.bias" in sd)
    sd["token_ids"] = torch.arange(target.config.vocab_size)  # the full vocabulary
    return head, sd
