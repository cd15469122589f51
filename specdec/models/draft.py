"""The reduced-head draft model: a small Llama on the target's frozen embeddings with a reduced LM head.

On-disk format (a directory):

- ``specdec_draft.json``   marker + config: ``{"format": "specdec-draft", "version": 1,
  "llama_config": {...}, "head_vocab_size": H, "full_vocab_size": V, ...}``
- ``draft.safetensors``    the draft's own (trained) parameters: transformer layers, final norm,
  reduced head ``lm_head.weight`` [H, hidden] and the index buffer ``token_ids`` [H] (int64,
  the full-vocabulary id of each head row)
- ``embeddings.safetensors``  ``model.embed_tokens.weight`` [V, hidden], the target's embeddings
  (frozen, shared; stored separately so the trained part stays small)
- tokenizer files (a copy of the target's tokenizer)

``load_draft(path)`` returns a :class:`ReducedHeadLlamaForCausalLM`, called exactly like a
Hugging Face causal LM: ``model(input_ids=..., past_key_values=DynamicCache(), use_cache=True)``.
``out.logits`` is ``[batch, n, V]`` float32 over the FULL vocabulary; columns outside the reduced
head vocabulary are ``-inf`` so softmax/sampling over it is exact w.r.t. the reported q.

File names: :mod:`specdec.models.files`. The demo builds and trains this model
(``specdec.demo.build``); nothing here depends on how.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.models.files import DRAFT_EMBEDDINGS, DRAFT_FILES, DRAFT_FORMAT, DRAFT_MARKER, DRAFT_VERSION, DRAFT_WEIGHTS


class ReducedHeadLlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose head only scores ``token_ids``; logits scattered into a full -inf row."""

    def __init__(self, config: LlamaConfig, head_vocab_size: int):
        config.tie_word_embeddings = False
        super().__init__(config)
        self.lm_head = nn.Linear(config.hidden_size, head_vocab_size, bias=False)
        self.register_buffer("token_ids", torch.arange(head_vocab_size, dtype=torch.long), persistent=True)
        self.head_vocab_size = head_vocab_size

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head logits over the reduced vocabulary (row j scores token ``token_ids[j]``)."""
        return self.lm_head(hidden)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, logits_to_keep=0, labels=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):  # positions (the batched runner's rows)
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.head_logits(hidden), past_key_values=out.past_key_values)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] final hidden states -> [..., vocab] float32 logits, -inf outside the head's vocabulary."""
        small = self.lm_head(hidden).float()
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        full.index_copy_(-1, self.token_ids, small)
        return full


def draft_llama_config(target_config: LlamaConfig | dict, num_layers: int) -> LlamaConfig:
    d = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    for k in ("quantization_config", "_name_or_path", "architectures", "transformers_version", "dtype",
              "torch_dtype"):
        d.pop(k, None)
    d["num_hidden_layers"] = num_layers
    d["tie_word_embeddings"] = False
    d["use_cache"] = True
    cfg = LlamaConfig(**d)
    cfg.architectures = ["ReducedHeadLlamaForCausalLM"]
    return cfg


def draft_files(path: Path) -> list[Path]:
    path = Path(path)
    return [path / name for name in DRAFT_FILES]


def save_draft(model: ReducedHeadLlamaForCausalLM, path: Path, extra: dict | None = None) -> None:
    """Write the draft directory (marker last). Trained weights stored in bf16 except token_ids."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    emb = {"model.embed_tokens.weight": sd.pop("model.embed_tokens.weight").to(torch.bfloat16).contiguous()}
    own = {k: (v if k == "token_ids" else v.to(torch.bfloat16)).contiguous() for k, v in sd.items()}
    save_file(emb, str(path / DRAFT_EMBEDDINGS))
    save_file(own, str(path / DRAFT_WEIGHTS))
    meta = {
        "format": DRAFT_FORMAT,
        "version": DRAFT_VERSION,
        "llama_config": model.config.to_dict(),
        "head_vocab_size": int(model.head_vocab_size),
        "full_vocab_size": int(model.config.vocab_size),
        "weights": DRAFT_WEIGHTS,
        "embeddings": DRAFT_EMBEDDINGS,
        "trained_parameters": int(sum(v.numel() for k, v in own.items() if k != "token_ids")),
        **(extra or {}),
    }
    (path / DRAFT_MARKER).write_text(json.dumps(meta, indent=2, default=str))


def is_draft_dir(path: Path) -> bool:
    return all(p.is_file() for p in draft_files(Path(path)))


def load_draft(path, dtype: torch.dtype = torch.float32) -> ReducedHeadLlamaForCausalLM:
    """Load a specdec draft directory as an eval-mode module in ``dtype`` (logits are float32)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / DRAFT_MARKER).read_text())
    if meta.get("format") != DRAFT_FORMAT:
        raise ValueError(f"{path / DRAFT_MARKER} is not a specdec draft marker")
    cfg_d = dict(meta["llama_config"])
    cfg_d.pop("transformers_version", None)
    cfg = LlamaConfig(**cfg_d)
    cfg.dtype = dtype
    with torch.device("meta"):
        model = ReducedHeadLlamaForCausalLM(cfg, int(meta["head_vocab_size"]))
    sd = load_file(str(path / meta.get("weights", DRAFT_WEIGHTS)))
    sd.update(load_file(str(path / meta.get("embeddings", DRAFT_EMBEDDINGS))))
    sd = {k: (v if k == "token_ids" else v.to(dtype)) for k, v in sd.items()}
    # rotary inv_freq is a non-persistent buffer: materialise the module then load.
    model = model.to_empty(device="cpu")
    model.model.rotary_emb.__init__(config=cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise ValueError(f"draft weights mismatch: missing={missing} unexpected={unexpected}")
    model.token_ids = sd["token_ids"].long()
    model.config.specdec_head_vocab_size = int(meta["head_vocab_size"])
    return model.to(dtype).eval()
