"""The drafters, by mode: one file each, one entry each in ``DRAFTERS``.

Every drafter is a ``BatchDrafter`` (``specdec.drafters.base``). Where it runs follows from
what it reads: ``"loop"`` (no model: in the step loop itself), ``"draft"`` (its own model: in
the unit's process or the DraftWorker) or ``"target"`` (the target's own pool and features:
next to the target, in the TargetWorker in ``actors`` mode). The step loop, the target's step
and the engine's builders read this table and nothing else; adding a drafter is a file here,
an entry below and its name in ``specdec.config.Mode``.

A tree mode (``draft_tree``, ``eagle_tree``) is its chain drafter asked for token trees: its
entry names the drafter it shares (``tree_of``) and builds nothing of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from specdec.batch.runner import BatchRunner
from specdec.config import ModelConfig, SpeculationConfig
from specdec.drafters.base import BatchDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.early_exit import EarlyExitDrafter, exit_parts
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.hardware import HALF_WEIGHTS
from specdec.loading import DTYPES, dtype_name, load_model
from specdec.models.eagle import load_eagle_head
from specdec.models.medusa import load_medusa_heads

Where = Literal["loop", "draft", "target"]


@dataclass(frozen=True)
class DrafterKind:
    """How to offer and build one drafter: ``build(models, speculation, target, capacity)``,
    ``target`` the target's runner (None away from it), ``capacity`` its pool's tokens."""

    where: Where
    offered: Callable[[ModelConfig], bool]
    build: Callable[[ModelConfig, SpeculationConfig, BatchRunner | None, int], BatchDrafter] | None
    tree_of: str | None = None  # a tree mode: the drafter it asks for trees

    @property
    def trees(self) -> bool:
        return self.tree_of is not None


def _ngram(models: ModelConfig, spec: SpeculationConfig, target, capacity: int) -> NgramDrafter:
    return NgramDrafter(spec.ngram_min, spec.ngram_max)


def _draft(models: ModelConfig, spec: SpeculationConfig, target, capacity: int) -> ModelDrafter:
    """The draft model on a pool of the target's size (the step loop lays out both alike)."""
    model = load_model(models.draft, models.draft_dtype, models.device, revision=models.draft_revision,
                       trust_remote_code=models.trust_remote_code)
    return ModelDrafter(BatchRunner(model, capacity_tokens=capacity), spec.tree_width)


def _early_exit(models: ModelConfig, spec: SpeculationConfig, target: BatchRunner, capacity: int) -> EarlyExitDrafter:
    stack, head = exit_parts(target.model, models.early_exit_layer, models.early_exit_adapter)
    return EarlyExitDrafter(target, stack, head, spec.early_exit_threshold)


def _head_dtype(dtype: str, target: BatchRunner) -> dict:
    """A head on the target's features: ``auto`` runs it in the target's dtype, on fp16 weights
    where the target's are (``float16-weights``). The loaders' ``dtype`` and ``half``."""
    if dtype != "auto":
        return {"dtype": DTYPES[dtype]}
    return {"dtype": next(target.model.parameters()).dtype, "half": dtype_name(target.model) == HALF_WEIGHTS}


def _eagle(models: ModelConfig, spec: SpeculationConfig, target: BatchRunner, capacity: int) -> EagleDrafter:
    head = load_eagle_head(models.eagle_head, target.model, **_head_dtype(models.eagle_dtype, target))
    return EagleDrafter(target, head, spec.tree_width)


def _medusa(models: ModelConfig, spec: SpeculationConfig, target: BatchRunner, capacity: int) -> MedusaDrafter:
    return MedusaDrafter(target, load_medusa_heads(models.medusa_heads, target.model,
                                                     **_head_dtype(models.medusa_dtype, target)),
                         spec.tree_width)


DRAFTERS: dict[str, DrafterKind] = {
    "ngram": DrafterKind("loop", lambda m: True, _ngram),
    "draft": DrafterKind("draft", lambda m: bool(m.draft), _draft),
    "draft_tree": DrafterKind("draft", lambda m: bool(m.draft), None, tree_of="draft"),
    "early_exit": DrafterKind("target", lambda m: bool(m.early_exit_adapter or m.early_exit_layer is not None),
                              _early_exit),
    "eagle": DrafterKind("target", lambda m: bool(m.eagle_head), _eagle),
    "eagle_tree": DrafterKind("target", lambda m: bool(m.eagle_head), None, tree_of="eagle"),
    "medusa": DrafterKind("target", lambda m: bool(m.medusa_heads), _medusa),
    "medusa_tree": DrafterKind("target", lambda m: bool(m.medusa_heads), None, tree_of="medusa"),
}


def drafter_of(mode: str) -> str:
    """The drafter a mode drafts with (a tree mode's chain drafter)."""
    return DRAFTERS[mode].tree_of or mode


def offered_modes(models: ModelConfig) -> list[str]:
    """The drafters a model configuration offers, in ``DRAFTERS`` order."""
    return [mode for mode, kind in DRAFTERS.items() if kind.offered(models)]


def build_drafters(where: Where, models: ModelConfig, spec: SpeculationConfig, target: BatchRunner | None,
                   capacity: int) -> dict[str, BatchDrafter]:
    """The offered drafters that run ``where``, by the name tree modes share (``drafter_of``)."""
    return {mode: kind.build(models, spec, target, capacity) for mode, kind in DRAFTERS.items()
            if kind.where == where and kind.offered(models) and kind.build is not None}
