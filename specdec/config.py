"""Typed configuration, validated once at the edge. Unknown keys are an error."""

from __future__ import annotations

import hashlib
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec import __version__

Mode = Literal["auto", "draft", "draft_tree", "ngram", "early_exit", "eagle", "eagle_tree", "medusa",
               "medusa_tree", "off"]  # what a request or a config may ask for
MODES: tuple[str, ...] = get_args(Mode)
DType = Literal["auto", "float32", "bfloat16", "float16", "float16-weights"]  # auto: specdec.hardware.resolve_dtype
# A head on the target's features (EAGLE, Medusa): auto follows the target (its torch dtype, and fp16 weights
# under a float16-weights target: ``specdec.drafters._head_dtype``); float16-weights is not asked of a head alone.
HeadDType = Literal["auto", "float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    target: str = Field(description="Target model: a Hugging Face id or a local path.")
    draft: str | None = Field(
        None, description="Draft model with the target's tokenizer; None disables mode 'draft'."
    )
    served_model_name: str | list[str] | None = Field(
        None, description="The name clients send as `model` (several: aliases, the first is the one "
        "responses carry); defaults to the target's path (vLLM's --served-model-name)."
    )
    revision: str | None = Field(
        None, description="The target's hub revision (a branch, tag or commit): pin it in production."
    )
    draft_revision: str | None = Field(None, description="The draft's hub revision.")
    tokenizer: str | None = Field(
        None, description="Where the tokenizer comes from (a hub id or a path); default: the target."
    )
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with a hub repository. Off unless you trust it."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Cap the context (prompt + output) below the model's own; None: the model's."
    )
    dtype: DType = Field(
        "auto",
        description="Target dtype. auto: bfloat16 on a GPU and on a CPU with native bf16 instructions "
        "(AVX-512 BF16, AMX), where a (k+1)-token verify pass costs about one step; on other x86 CPUs "
        "float16-weights (float32 arithmetic on weights stored as float16: half the bytes a product reads), "
        "where bf16 is emulated and verifying k drafts costs nearly k steps; float32 elsewhere. "
        "float16-weights is a CPU format. With numerics: fast, bf16 "
        "rounds a (k+1)-token pass and single steps differently and greedy output can differ at near-ties.",
    )
    numerics: Literal["batch_invariant", "fast"] = Field(
        "batch_invariant",
        description="batch_invariant: a token's logits do not depend on how many tokens its row carries or "
        "what else is in the step (each query of a draft row attends alone, as a plain decode step's does; "
        "prompts are chunked at fixed places), so greedy output is the same with speculation on or off and "
        "alone or batched, in bf16 too. fast: rows with few queries share one padded attention call per "
        "layer (faster at many rows, on a GPU above all; bf16 rounds differently per batch).",
    )
    draft_dtype: DType = Field("float32", description="Draft dtype (small drafts are fast in fp32).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the models run; auto takes the GPU when there is one."
    )
    early_exit_adapter: str | None = Field(
        None,
        description="A trained exit adapter directory (`specdec demo-models` writes demo/exit/layer{L}); "
        "it names its exit layer. Enables mode 'early_exit': the target's first layers draft on the "
        "target's own KV cache, so it costs no second model and no second cache.",
    )
    eagle_head: str | None = Field(
        None,
        description="An EAGLE head directory (`specdec demo-models` writes demo/eagle; EAGLE-1's released "
        "layout loads too). Enables mode 'eagle': a one-layer head drafts from the target's own last "
        "hidden states, kept by the verify pass, so it costs no second model and no extra target pass.",
    )
    eagle_dtype: HeadDType = Field(
        "auto", description="EAGLE head dtype. auto: the target's (its matrices are read from memory every "
        "draft step, and bf16 halves that where the target runs in bf16: a demo head's draft step cost about 30% "
        "less on a 2-core AVX-512 BF16 CPU), on fp16 weights where the target is float16-weights (4.06 -> "
        "2.39 ms a demo draft token on a 2-core AVX2-only EPYC); the head's numerics never change the output.")
    medusa_heads: str | None = Field(
        None,
        description="A Medusa heads directory (`specdec demo-models` writes demo/medusa; Medusa-1's released "
        "layout loads too). Enables mode 'medusa': small heads on the target's own last hidden state "
        "guess the next tokens all at once (a chain, or a token tree), so one batched head pass drafts "
        "every row: no second model, no extra target pass; weaker the further out a head looks.",
    )
    medusa_dtype: HeadDType = Field("auto", description="Medusa heads dtype. auto: the target's (as eagle_dtype).")
    early_exit_layer: int | None = Field(
        None,
        ge=1,
        description="Exit after this many target layers. Without an adapter this is a raw exit through "
        "the target's final norm and LM head: cheap to set up but a poor draft on pretrained models "
        "(3-34 % agreement on SmolLM2); deeper exits agree more and cost more per draft token.",
    )

    @property
    def names(self) -> list[str]:
        """Every name the model answers to; the first is the one responses carry."""
        if isinstance(self.served_model_name, list):
            return list(self.served_model_name) or [self.target]
        return [self.served_model_name or self.target]

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: the build and what changes greedy output (the dtype:
        bf16 rounds differently at near-ties), plus a hash of the whole model configuration."""
        from specdec.hardware import resolve_dtype  # torch: not for a process that never asks

        digest = hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:10]
        return f"specdec-{__version__}-{resolve_dtype(self.dtype, self.device)}-{digest}"


# vLLM's speculative_config names, accepted so that a vLLM user can move a config over.
VLLM_METHODS = {"ngram": "ngram", "draft_model": "draft", "eagle": "eagle", "medusa": "medusa"}
VLLM_NAMES = {"method": "mode", "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max"}


class SpeculationConfig(_Strict):
    """How the unit speculates. vLLM's names are aliases: ``method`` (``ngram``, ``draft_model``, ``eagle``),
    ``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max``."""

    mode: Mode = Field("auto", description="Default mode; a request may ask for another.")
    num_speculative_tokens: int = Field(
        4, ge=1, le=32, description="k: more drafts pay when acceptance is high, cost when it is low."
    )
    ngram_min: int = Field(1, ge=1, description="Shortest suffix prompt lookup matches.")
    ngram_max: int = Field(4, ge=1, description="Longest suffix tried first (more specific).")
    early_exit_threshold: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="early_exit stops drafting a round after a token whose exit probability is below "
        "this (adaptive draft length at no extra cost); 0 always drafts k. Higher saves draft steps "
        "that would likely be rejected, but also cuts rounds that would have been accepted.",
    )

    tree_width: int = Field(
        6, ge=1, le=16, description="Token trees (modes draft_tree, eagle_tree): each expanded node's "
        "most likely tokens tried, and nodes expanded per level. Wider trees hold the target's token "
        "more often and cost more draft rows per pass; the node budget (tree_nodes) stays. On the "
        "demo pair (chat, greedy, 16 nodes) widths 4 / 6 / 8 gave EAGLE trees a mean accepted length "
        "of 1.86 / 1.90 / 1.91 at 25.9 / 25.2 / 22.0 tokens/s (2-core AMD EPYC, AVX-512 BF16)."
    )

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data):
        if not isinstance(data, dict) or not any(k in data for k in VLLM_NAMES):
            return data
        data = dict(data)
        for theirs, ours in VLLM_NAMES.items():
            if theirs not in data:
                continue
            if ours in data:
                raise ValueError(f"{theirs} is vLLM's name for {ours}: give one of them")
            value = data.pop(theirs)
            if theirs == "method":
                if value not in VLLM_METHODS:
                    raise ValueError(f"method {value!r}: this server implements {sorted(VLLM_METHODS)} of vLLM's "
                                     "methods (mode: auto, draft, ngram, early_exit, eagle, medusa, off)")
                value = VLLM_METHODS[value]
            data[ours] = value
        return data

    @model_validator(mode="after")
    def _ngram_range(self) -> "SpeculationConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        return self
