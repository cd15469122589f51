"""A Llama decoder stack run as plain tensor code for the batched runner's step.

transformers' ``LlamaModel.forward`` is correct for every use, and pays for it on each call:
output-capturing and deprecation wrappers, a causal-mask builder, a cache interface, and about
ten ``nn.Module`` calls a layer, each through hooks machinery. On a CPU serving a small model
that Python is a large share of a decode step (the demo target, 30 layers, one row, float32, a
2-core AMD EPYC with AVX2 only: 53 ms a dense forward, of which its 121 products take 28 ms).

``LeanLlama`` runs the same layers on the same weights with the same operations in the same
order, so a step's logits equal ``LlamaForCausalLM``'s bit for bit (``tests/test_lean.py``):
RMSNorm as ``LlamaRMSNorm`` computes it, rotary embeddings from the model's own
``rotary_emb``, the products on the packed (and fused) weights ``specdec.models.packed`` made,
keys and values into the pool, attention by ``specdec.batch.attention`` for the bound step.
Only what a step never uses is left out. The final norm is called as its module, so its
forward hooks (the runner's feature capture) still fire.

The early-exit drafter runs its first layers the same way (``layers(..., upto=L)``).

It serves only models it can run exactly (``LeanLlama.supports``: Llama's own classes, SiLU,
no dropout); anything else keeps transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.batch import attention
from specdec.models import packed


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _products(layers: list[torch.nn.Linear], x: torch.Tensor, fast: bool) -> list[torch.Tensor]:
    """Each layer's output for ``x``: one product where they are fused siblings
    (``packed.Siblings``) and ``fast`` (where their own forward would use the packed weight)."""
    siblings = getattr(layers[0], "siblings", None)
    if fast and siblings is not None and siblings.members == layers:
        return siblings._product(x)
    return [layer(x) for layer in layers]


class LeanLlama:
    """The decoder stack of a transformers ``LlamaForCausalLM`` (or a subclass that keeps its
    stack), for ``BatchRunner`` steps: ``hidden(input_ids, position_ids, cache)`` -> the final
    norm's output [1, T, d]."""

    def __init__(self, model: torch.nn.Module):
        assert self.supports(model), type(model).__name__
        self.base = model.model
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim ** -0.5

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Is ``model`` a Llama stack this runs exactly as transformers does?"""
        from transformers.models.llama import modeling_llama as ml

        base = getattr(model, "model", None)
        if type(base) is not ml.LlamaModel or getattr(model.config, "hidden_act", None) != "silu":
            return False
        if getattr(model.config, "attention_dropout", 0.0) and model.training:
            return False
        return all(type(layer) is ml.LlamaDecoderLayer and type(layer.self_attn) is ml.LlamaAttention
                   and type(layer.mlp) is ml.LlamaMLP and type(layer.input_layernorm) is ml.LlamaRMSNorm
                   and type(layer.post_attention_layernorm) is ml.LlamaRMSNorm for layer in base.layers)

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """input_ids, position_ids [1, T]; ``cache`` a ``FlatBatchCache`` whose step is bound.
        Returns the final norm's output [1, T, d]."""
        return self.base.norm(self.layers(input_ids, position_ids, cache))

    def layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, upto: int | None = None) -> torch.Tensor:
        """The residual stream [1, T, d] after the first ``upto`` layers (all: None), not normed."""
        base = self.base
        h = base.embed_tokens(input_ids)  # [1, T, d]
        cos, sin = base.rotary_emb(h, position_ids=position_ids)  # [1, T, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        shape = (*input_ids.shape, -1, self.head_dim)
        weight = base.layers[0].self_attn.q_proj.weight
        fast = (h.device.type == "cpu" and h.dtype == weight.dtype and packed.available(h.dtype)
                and not packed.stocked() and not torch.is_grad_enabled())
        for i, layer in enumerate(base.layers[: upto or base.config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            x = _rms_norm(h, norm1.weight, norm1.variance_epsilon)
            q, k, v = _products([attn.q_proj, attn.k_proj, attn.v_proj], x, fast)
            q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            keys, values = cache.update(k, v, i)
            out, _ = attention.ragged_attention(attn, q, keys, values, None, scaling=self.scaling)
            h = h + attn.o_proj(out.reshape(*input_ids.shape, -1).contiguous())
            x = _rms_norm(h, norm2.weight, norm2.variance_epsilon)
            gate, up = _products([mlp.gate_proj, mlp.up_proj], x, fast)
            h = h + mlp.down_proj(F.silu(gate) * up)
        return h
