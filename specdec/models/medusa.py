"""Medusa heads: K small heads on the TARGET's last hidden state, each guessing a token further out.

Medusa-1 (Cai et al., 2024). Head ``i`` (``0 <= i < K``) reads the target's final hidden state
``f_t`` at position ``t`` (after its final norm: what the target's LM head reads, what
``BatchRunner.keep_features`` keeps) and predicts token ``x_{t+i+2}``: the target's own LM head
at ``t`` predicts ``x_{t+1}`` (the pending token of a round), head 0 the one after it, and so on.
No head sees the tokens between ``t`` and the one it predicts, so the heads are cheap (one
batched pass for all of them) and weaker the further out they look.

Worked example (context ``x0 x1 x2``; the target has fed ``x0 x1``, so ``f1`` is known and its
LM head already gave the pending token ``x2``)::

    head 0 on f1 -> x3      head 1 on f1 -> x4      head 2 on f1 -> x5

Each head is ``num_layers`` ResBlocks ``x + SiLU(Linear(x))`` (the Linear's weight starts at
zero, as in Medusa, so an untrained head is the base LM head on ``f_t + SiLU(bias)``), then an
LM head. Two LM-head forms:

- ours (``token_ids`` given): one shared reduced-vocabulary head, rows ``token_ids`` of the
  target's own frozen LM head (never stored with the heads); logits over the full vocabulary
  are ``-inf`` outside ``token_ids``.
- Medusa's released checkpoints: each head its own full-vocabulary ``Linear(d, V, bias=False)``.

On-disk formats (a directory), both recognised by ``load_medusa_heads``:

- ours: ``specdec_medusa.json`` (marker + config, written last) and ``medusa.safetensors``
  (``heads.{i}.{j}.linear.weight`` / ``.bias``, the ``token_ids`` buffer [H] int64);
- Medusa's: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` (or ``.pt``) with keys
  ``{i}.{j}.linear.weight`` / ``{i}.{j}.linear.bias`` (ResBlock ``j < num_layers``) and
  ``{i}.{num_layers}.weight`` (head ``i``'s own LM head [V, d]).

How the demo trains heads is :mod:`specdec.demo.medusa`; how they draft chains and token trees
in the step loop is :mod:`specdec.drafters.medusa`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec.loading import load_weights
from specdec.models.files import MEDUSA_FORMAT, MEDUSA_MARKER, MEDUSA_VERSION, MEDUSA_WEIGHTS
from specdec.models.packed import PackedRows, pack_linears


class ResBlock(nn.Module):
    """Medusa's residual block ``x + SiLU(W x + b)``; ``W`` starts at zero (the identity but a
    small shift), so an untrained head starts at the base LM head."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``K`` heads of ``num_layers`` ResBlocks each on [.., d] features.

    ``hidden(features [N, d]) -> [N, K, d]``; ``reduced_logits(features) -> [N, K, H]``
    (column ``j`` scores ``token_ids[j]``); ``logits(features) -> [N, K, V]`` float32 over the
    full vocabulary. ``own_heads=True``: each head has its own full-vocabulary LM head (Medusa's
    released layout; ``token_ids`` is then the whole vocabulary); otherwise ``bind_target``
    reads rows ``token_ids`` of the target's LM head, shared by all heads.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, *,
                 head_vocab_size: int | None = None, own_heads: bool = False):
        super().__init__()
        assert num_heads >= 1 and num_layers >= 0, (num_heads, num_layers)
        d = hidden_size
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.own_heads = num_heads, num_layers, own_heads
        blocks = [[ResBlock(d) for _ in range(num_layers)] for _ in range(num_heads)]
        if own_heads:  # Medusa's: ResBlocks then the head's own LM head, index num_layers
            blocks = [b + [nn.Linear(d, vocab_size, bias=False)] for b in blocks]
        self.heads = nn.ModuleList(nn.Sequential(*b) for b in blocks)
        h = vocab_size if own_heads or head_vocab_size is None else head_vocab_size
        self.register_buffer("token_ids", torch.arange(h, dtype=torch.long))
        self.register_buffer("head_weight", torch.zeros(h if not own_heads else 0, d), persistent=False)
        self.rows = PackedRows()  # the product with ``head_weight``: packed, as the layers' are

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def bind_target(self, target: nn.Module) -> "MedusaHeads":
        """Read the target's LM head rows ``token_ids`` (ours; Medusa's own heads need nothing)."""
        out = target.get_output_embeddings()
        if out.weight.shape[1] != self.hidden_size:
            raise ValueError(f"the heads are {self.hidden_size} wide, the target {out.weight.shape[1]}")
        if self.vocab_size != out.weight.shape[0]:
            raise ValueError(f"the heads were made for a vocabulary of {self.vocab_size}, the target has "
                             f"{out.weight.shape[0]}")
        if self.own_heads:
            return self
        if int(self.token_ids.max()) >= out.weight.shape[0]:
            raise ValueError("the heads' vocabulary does not fit the target's")
        full = len(self.token_ids) == out.weight.shape[0] and torch.equal(
            self.token_ids.cpu(), torch.arange(len(self.token_ids)))
        with torch.no_grad():
            rows = out.weight.detach() if full else out.weight[self.token_ids].detach()  # full: shared, no copy
            self.head_weight = rows if rows.dtype == self.dtype else rows.to(self.dtype)
        return self

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, K, d]: each head's ResBlocks (ours; the input of the shared LM head)."""
        assert not self.own_heads
        x = features.to(self.dtype)
        return torch.stack([head(x) for head in self.heads], -2)

    def reduced_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, K, H]."""
        if self.own_heads:
            x = features.to(self.dtype)
            return torch.stack([head(x) for head in self.heads], -2)
        assert self.head_weight.shape[0] == len(self.token_ids), "bind_target first"
        return self.rows(self.hidden(features), self.head_weight)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, K, V] float32; ``-inf`` outside ``token_ids``."""
        small = self.reduced_logits(features).float()
        if len(self.token_ids) == self.vocab_size and self.own_heads:
            return small
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_ids, small)


def save_medusa_heads(heads: MedusaHeads, path: Path, extra: dict | None = None, dtype=torch.bfloat16) -> None:
    """Write our directory (marker last); weights in ``dtype`` except ``token_ids``."""
    from safetensors.torch import save_file

    assert not heads.own_heads, "our format shares the target's LM head"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: (v if k == "token_ids" else v.to(dtype)).contiguous() for k, v in heads.state_dict().items()}
    save_file(sd, str(path / MEDUSA_WEIGHTS))
    meta = {"format": MEDUSA_FORMAT, "version": MEDUSA_VERSION, "hidden_size": heads.hidden_size,
            "vocab_size": heads.vocab_size, "num_heads": heads.num_heads, "num_layers": heads.num_layers,
            "head_vocab_size": len(heads.token_ids), "weights": MEDUSA_WEIGHTS, **(extra or {})}
    (path / MEDUSA_MARKER).write_text(json.dumps(meta, indent=2, default=str))


def is_medusa_dir(path) -> bool:
    path = Path(path)
    return (path / MEDUSA_MARKER).is_file() or _released_weights(path) is not None


def load_medusa_heads(path, target: nn.Module, dtype: torch.dtype = torch.float32, half: bool = False) -> MedusaHeads:
    """Heads from a directory (ours or Medusa's released layout; a Hugging Face repo id is
    downloaded first), bound to ``target``, in eval mode; ``half``: their products on fp16
    weights (``specdec.models.packed``), as a ``float16-weights`` target's are."""
    path = Path(path)
    if not path.exists() and "/" in str(path) and not str(path).startswith(("/", ".")):
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path)))
    d, vocab = target.get_output_embeddings().weight.shape[1], target.config.vocab_size
    if (path / MEDUSA_MARKER).is_file():
        meta = json.loads((path / MEDUSA_MARKER).read_text())
        if meta.get("format") != MEDUSA_FORMAT:
            raise ValueError(f"{path / MEDUSA_MARKER} is not a specdec Medusa marker")
        heads = MedusaHeads(meta["hidden_size"], meta["vocab_size"], meta["num_heads"], meta["num_layers"],
                            head_vocab_size=meta["head_vocab_size"])
        sd = load_weights(path / meta.get("weights", MEDUSA_WEIGHTS))
    elif (file := _released_weights(path)) is not None:
        cfg = json.loads((path / "config.json").read_text())
        raw = {k.removeprefix("medusa_head."): v for k, v in load_weights(file).items()}
        num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
        heads = MedusaHeads(d, vocab, num_heads, num_layers, own_heads=True)
        sd = {"heads." + k: v for k, v in raw.items()}
        sd["token_ids"] = torch.arange(vocab)
    else:
        raise FileNotFoundError(f"{path} holds no Medusa heads ({MEDUSA_MARKER}, or Medusa's config.json + "
                                "medusa_lm_head.safetensors / .pt)")
    sd = {k: (v.long() if k == "token_ids" else v.to(dtype)) for k, v in sd.items()}
    missing, unexpected = heads.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "head_weight"]
    if missing or unexpected:
        raise ValueError(f"Medusa weights mismatch: missing={missing} unexpected={unexpected}")
    heads = heads.to(dtype=dtype, device=next(target.parameters()).device)
    heads = heads.bind_target(target).eval()
    pack_linears(heads, half=half)
    heads.rows.half = half
    return heads


_RELEASED_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def _released_weights(path: Path) -> Path | None:
    """Medusa's weights file when ``path`` is in its released layout (config.json names the heads)."""
    if not (path / "config.json").is_file():
        return None
    try:
        if "medusa_num_heads" not in json.loads((path / "config.json").read_text()):
            return None
    except ValueError:
        return None
    return next((path / f for f in _RELEASED_WEIGHTS if (path / f).is_file()), None)
