"""``early_exit``: self-speculation. The target's first ``L`` layers plus an exit head draft;
the full target verifies, exactly as for any other drafter.

The drafter holds no model and no cache of its own. It runs layers ``0 .. L-1`` of the target
on the target's own token pool (the target's ``BatchRunner``), then an exit head: the
target's final norm and LM head (a raw exit) or a trained adapter
(``specdec.models.exit_adapter``). Only the target's layer stack is borrowed; its weights are
never written.

Why the verify pass stays exact. After a verify the target's pool holds every row's context
but its last token, in every layer. A round:

1. **Align.** A row the target holds less of (its first round, a restarted worker) is caught
   up through the FULL model first: work the verify pass would otherwise do.
2. **Draft.** Feed ``context[-1]``, then each drafted token, through layers ``0 .. L-1`` only,
   at the row's next positions: the shallow layers see the keys and values a separate
   shallow model would hold (the target's own, computed by the same layers), so the drafts
   are those of a separate early-exit model, and no prefix is ever recomputed for drafting.
   The runner's record of what each row holds does not move.
3. **Verify.** The full model scores ``context[-1] + drafts`` at those same positions and
   rewrites every layer there, so the shallow writes of step 2 are overwritten before anything
   reads them as the target's. Reusing them would save ``L / N`` of a nearly flat cost at the
   price of a second code path; not done.

Worked example (N = 4 layers, L = 2, context = [a, b, c], k = 2)::

    after the last verify    layers 0-3: [a, b]
    draft: feed c            layers 0-1: [a, b, c]        -> d1
           feed d1           layers 0-1: [a, b, c, d1]    -> d2     (the runner still says [a, b])
    verify [c, d1, d2]       layers 0-3: [a, b, c, d1, d2] -> then rolled back to the accepted

Confidence stop (optional): a row stops drafting after a token whose probability under the
exit's own distribution is below ``threshold``. The token is still proposed (it cost nothing
more to verify); only the further draft steps are saved. The stop depends on the draft alone,
so sampling stays exact. Works for Llama-style models and GPT-2 (``ShallowStack``).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.batch.cache import RowPlan
from specdec.batch.lean import LeanLlama
from specdec.batch.runner import BatchRow, BatchRunner
from specdec.drafters.base import Chains, Drafted, DraftRow
from specdec.models.exit_adapter import load_exit_adapter


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
        self.lean = LeanLlama(model) if self.arch == "llama" and LeanLlama.supports(model) else None

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
        plans = [RowPlan(runner.blocks_of(key), pos, 1) for key, pos in zip(keys, positions)]
        input_ids = torch.tensor([feeds], dtype=torch.long, device=runner.device)
        position_ids, mask = runner.cache.plan(plans)
        try:
            if self.lean is not None:  # as the runner's own steps run (``specdec.batch.lean``)
                return self.lean.layers(input_ids, position_ids, runner.cache, upto=self.num_layers)[0]
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


class EarlyExitDrafter:
    """Self-speculation on the target's pool: its first layers plus an exit head.

    It writes only layers ``0..L-1`` at positions the verify pass rewrites for every layer
    right after, and never moves the runner's record of what each row holds, so no restore
    is needed. ``head`` maps hidden states [n, d] to full-vocabulary float32 logits [n, V]
    (a reduced-vocabulary head returns -inf outside its vocabulary, so ``q`` stays exact).
    """

    name = "early_exit"

    def __init__(self, runner: BatchRunner, stack: ShallowStack, head: nn.Module, threshold: float = 0.0):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.runner, self.stack, self.head = runner, stack, head.eval()
        self.head_dtype = next(head.parameters()).dtype
        self.threshold = threshold

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow]) -> Drafted:
        runner = self.runner
        # 1. align: the target's cache must hold each row's context but its last token (it does
        # after the previous verify; after a restart the full model catches up first).
        behind = [BatchRow(r.key, r.context[:-1], 0, r.blocks) for r in rows
                  if r.k and runner.cached_ids(r.key) != r.context[:-1]]
        if behind:
            runner.forward(behind)
        chains = Chains(rows)
        with runner.lock:  # 2. draft: one token per live row per pass through the shallow layers
            while live := chains.live():
                feeds = [rows[i].context[-1] if not chains.tokens[i] else chains.tokens[i][-1] for i in live]
                base = [len(rows[i].context) - 1 + len(chains.tokens[i]) for i in live]
                hidden = self.stack.hidden_rows(runner, [rows[i].key for i in live], feeds, base)
                logits = self.head(hidden.to(self.head_dtype)).float().cpu()  # [len(live), V]
                chains.extend(logits, live, self.threshold)
        return chains.drafted()

    def release(self, key: str) -> None:
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
