"""``early_exit``: self-speculation. The target's first ``L`` layers plus an exit head draft;
the full target verifies, exactly as for any other drafter.

The drafter holds no model and no cache of its own. It runs layers ``0 .. L-1`` of the target
on the target's own per-sequence ``DynamicCache`` (the one in the target's ``ModelRunner``),
then an exit head: the target's final norm and LM head (a raw exit) or a trained adapter
(``specdec.models.exit_adapter``). Only the target's layer stack is borrowed; its weights are
never written.

Cache reuse, and why the verify pass stays exact. Between calls the runner's invariant holds:
every layer of a sequence's cache holds exactly the tokens ``seq.ids``. A round:

1. **Align.** The target's cache holds ``context[:-1]`` after the last verify (the round's
   last token is not fed). If it holds more, crop it (the verify pass would do the same); if
   less, feed the missing prefix through the FULL model (work the verify pass would otherwise
   do), so that all layers hold ``base = len(context) - 1`` tokens.
2. **Draft.** Feed ``context[-1]``, then each drafted token, through layers ``0 .. L-1`` only,
   on that same cache: the shallow layers see the same keys and values a separate shallow
   cache would hold (the target's own, computed by the same layers), so the drafts are those
   of a separate early-exit model - and no prefix is ever recomputed for drafting.
3. **Restore.** Crop layers ``0 .. L-1`` back to ``base`` (in ``finally``: also on error).
   Cropping only slices the tensors, so the cache is bit for bit what it was after step 1.
4. **Verify** (``decoding.verify_round``, unchanged): the full model scores
   ``context[-1] + drafts`` on that cache. It recomputes the shallow layers at the draft
   positions: at most ``k`` rows inside a ``(k + 1)``-token pass whose cost barely depends on
   ``k`` (v(9) = 1.16 on the demo target), which keeps the verify path, the rollback and the
   runner's one-invariant cache untouched. Reusing the shallow rows in the verify pass would
   save ``L / N`` of a nearly flat cost at the price of a second code path; not done.

Worked example (N = 4 layers, L = 2, context = [a, b, c], k = 2)::

    after the last verify    layers 0-3: [a, b]
    draft: feed c            layers 0-1: [a, b, c]        -> d1
           feed d1           layers 0-1: [a, b, c, d1]    -> d2
    restore                  layers 0-1: [a, b]           (crop 2; layers 2-3 never changed)
    verify [c, d1, d2]       layers 0-3: [a, b, c, d1, d2] -> then rolled back to the accepted

Confidence stop (optional): a round stops drafting after a token whose probability under the
exit's own distribution is below ``threshold``. The token is still proposed (it cost nothing
more to verify); only the further draft steps are saved. The stop depends on the draft alone,
so sampling stays exact. Works for Llama-style models and GPT-2 (``shallow_stack``).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.drafters.base import EMPTY_PROPOSAL, Proposal
from specdec.models.exit_adapter import load_exit_adapter
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, logits_to_probs, make_generator


class ShallowStack:
    """Layers ``0 .. num_layers-1`` of a causal LM, run on (and growing) a given cache.

    ``hidden(input_ids [1, n], cache) -> [1, n, d]``: the residual stream after layer
    ``num_layers - 1`` (before any final norm), exactly what the full model computes there.
    ``final_norm`` / ``lm_head``: the model's own output modules, for a raw exit.
    """

    def __init__(self, model: nn.Module, num_layers: int):
        self.model = model
        self.num_layers = num_layers
        if hasattr(model, "model") and hasattr(model.model, "layers"):  # Llama-style
            self.arch, self.base = "llama", model.model
            self.layers, self.final_norm = model.model.layers, model.model.norm
        elif hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2
            self.arch, self.base = "gpt2", model.transformer
            self.layers, self.final_norm = model.transformer.h, model.transformer.ln_f
        else:
            raise ValueError(f"early exit supports Llama-style and GPT-2 models, not {type(model).__name__}")
        if not 1 <= num_layers < len(self.layers):
            raise ValueError(f"exit layer must be in [1, {len(self.layers) - 1}], got {num_layers}")
        self.lm_head = model.lm_head

    def hidden(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        assert input_ids.dim() == 2 and input_ids.shape[0] == 1, input_ids.shape
        past = cache.get_seq_length()  # layer 0: a shallow layer, so drafts count
        position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
        embeds = self._embed(input_ids)
        mask = create_causal_mask(config=self.base.config, inputs_embeds=embeds, attention_mask=None,
                                  cache=cache, position_ids=position_ids)
        return self.layers_forward(input_ids, position_ids, mask, cache)

    def hidden_rows(self, runner, keys: list[str], feeds: list[int], positions: list[int]) -> torch.Tensor:
        """One token per row through the shallow layers, on a ``BatchRunner``'s pool: row i
        feeds ``feeds[i]`` at ``positions[i]`` (what the runner holds for it stays as it is).
        Returns the hidden states [rows, d]."""
        from specdec.batch.cache import RowPlan

        plans = [RowPlan(runner.start_of(key), pos, 1) for key, pos in zip(keys, positions)]
        input_ids = torch.tensor([feeds], dtype=torch.long, device=runner.device)
        position_ids, mask = runner.cache.plan(plans)
        try:
            return self.layers_forward(input_ids, position_ids, mask, runner.cache)[0]
        finally:
            runner.cache.unbind()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.base.embed_tokens(input_ids) if self.arch == "llama" else self.base.wte(input_ids)

    def layers_forward(self, input_ids, position_ids, mask, cache) -> torch.Tensor:
        """Layers ``0 .. num_layers-1`` with the given positions and attention mask."""
        if self.arch == "llama":
            h = self.base.embed_tokens(input_ids)
            rope = self.base.rotary_emb(h, position_ids=position_ids)
            for layer in self.layers[: self.num_layers]:
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=position_ids,
                          cache=cache, use_cache=True)
            return h
        h = self.base.drop(self.base.wte(input_ids) + self.base.wpe(position_ids))
        for block in self.layers[: self.num_layers]:
            h = block(h, cache, mask, None, encoder_attention_mask=None, use_cache=True,
                      position_ids=position_ids)
        return h


class RawExit(nn.Module):
    """The untrained exit: the target's own final norm and LM head on layer L's hidden state."""

    def __init__(self, stack: ShallowStack):
        super().__init__()
        self.exit_layer = stack.num_layers
        self.norm, self.head = stack.final_norm, stack.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, V] float32
        return self.head(self.norm(hidden)).float()


def crop_first_layers(cache, num_layers: int, length: int) -> None:
    """Crop layers ``0 .. num_layers-1`` of ``cache`` to ``length`` tokens (deeper ones untouched)."""
    for layer in cache.layers[:num_layers]:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)  # transformers 5.24: a negative argument removes that many tokens


class EarlyExitDrafter:
    """Drafts with the target's first ``exit_layer`` layers on the target's own KV cache.

    ``runner`` is the TARGET's runner (shared, not copied); ``head`` maps hidden states
    [n, d] to full-vocabulary float32 logits [n, V] (``RawExit`` when None); a reduced-
    vocabulary head returns -inf outside its vocabulary, so ``q`` stays exact.
    """

    name = "early_exit"

    def __init__(self, runner: ModelRunner, exit_layer: int, head: nn.Module | None = None,
                 *, threshold: float = 0.0):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.runner = runner
        self.stack = ShallowStack(runner.model, exit_layer)
        self.head = (head if head is not None else RawExit(self.stack)).eval()
        head_layer = getattr(self.head, "exit_layer", exit_layer)
        if head_layer != exit_layer:
            raise ValueError(f"the exit head was trained for layer {head_layer}, not {exit_layer}")
        self.head_dtype = next(self.head.parameters()).dtype
        self.threshold = threshold

    @property
    def exit_layer(self) -> int:
        return self.stack.num_layers

    def propose(
        self, seq_id: str, context: list[int], k: int, params: SamplingParams, seed: int
    ) -> Proposal:
        if k <= 0:
            return EMPTY_PROPOSAL
        # The runner's lock: the target must not run while its cache's layers disagree.
        with self.runner.lock, torch.inference_mode():
            # 1. align: every layer of the target's cache holds exactly context[:-1]; when
            # behind (first round, evicted) this feeds what the verify pass would feed anyway.
            seq = self.runner.hold(seq_id, context[:-1])
            base = len(seq.ids)
            self._check_croppable(seq.cache.layers[: self.exit_layer])
            try:
                return self._draft(seq.cache, context[-1], k, params, seed)
            finally:
                crop_first_layers(seq.cache, self.exit_layer, base)  # 3. restore: bit for bit as before

    @staticmethod
    def _check_croppable(layers: list) -> None:
        for i, layer in enumerate(layers):
            if getattr(layer, "is_sliding", False) or not getattr(layer, "is_croppable", True):
                raise ValueError(f"early exit needs full-attention, croppable cache layers (layer {i})")

    def _draft(self, cache, last: int, k: int, params: SamplingParams, seed: int) -> Proposal:
        """2. Feed the last context token, then each draft, through the shallow layers."""
        device = self.runner.device
        generator = None if params.greedy else make_generator(seed)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        feed = last
        for _ in range(k):
            h = self.stack.hidden(torch.tensor([[feed]], device=device), cache)[0]  # [1, d]
            logits = self.head(h.to(self.head_dtype))[0].float().cpu()  # [V]
            if params.greedy:
                token = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[token]) if self.threshold else 1.0
            else:
                q = logits_to_probs(logits, params)
                token = int(torch.multinomial(q, 1, generator=generator))
                rows.append(q)
                confidence = float(q[token])
            tokens.append(token)
            if confidence < self.threshold:
                break  # unsure: let the target speak before drafting further
            feed = token
        return Proposal(tokens=tokens, probs=torch.stack(rows) if rows else None)

    def release(self, seq_id: str) -> None:
        pass  # the cache is the target's: the target releases it


def exit_parts(
    model: nn.Module, exit_layer: int | None = None, adapter: str | None = None,
    *, dtype: torch.dtype = torch.float32,
) -> tuple[ShallowStack, nn.Module]:
    """The shallow stack and exit head for ``model``: a trained adapter (which names its layer),
    or a raw exit at ``exit_layer``."""
    head = None
    if adapter:
        head = load_exit_adapter(adapter, dtype=dtype, target_config=model.config)
        head = head.to(next(model.parameters()).device)
        if exit_layer is not None and head.exit_layer != exit_layer:
            raise ValueError(f"the exit head was trained for layer {head.exit_layer}, not {exit_layer}")
        exit_layer = head.exit_layer
    if exit_layer is None:
        raise ValueError("early_exit needs an exit layer or an exit adapter")
    stack = ShallowStack(model, exit_layer)
    return stack, (head if head is not None else RawExit(stack)).eval()


def load_early_exit(
    runner: ModelRunner, exit_layer: int | None = None, adapter: str | None = None,
    *, threshold: float = 0.0, dtype: torch.dtype = torch.float32,
) -> EarlyExitDrafter:
    """An ``early_exit`` drafter on the target's runner: a trained adapter, or a raw exit."""
    stack, head = exit_parts(runner.model, exit_layer, adapter, dtype=dtype)
    return EarlyExitDrafter(runner, stack.num_layers, head, threshold=threshold)
