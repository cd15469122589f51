"""The application's arguments (``args:`` in serve_config.yaml), validated once.

Unknown keys are an error: Ray Serve silently drops misspelled deployment keys, so we are
strict where we can be.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.config import ModelConfig, SpeculationConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerResources(_Strict):
    """Logical resources of the unit's placement-group bundles (``colocation: actors``).

    Bundle 0 is the router, 1 the target worker, 2 the draft worker; STRICT_PACK puts them on
    one node. On a GPU node give the target and draft fractions of one GPU.
    """

    router_cpus: float = Field(0.1, ge=0, description="The router mostly waits on workers.")
    target_cpus: float = Field(1.0, ge=0)
    target_gpus: float = Field(0.0, ge=0, le=1)
    draft_cpus: float = Field(0.5, ge=0)
    draft_gpus: float = Field(0.0, ge=0, le=1)


def resolve_models(models: ModelConfig) -> ModelConfig:
    """Replace demo names by the demo pair's paths (at build time, not when linting)."""
    return models.model_copy(
        update={
            "target": resolve_model_path(models.target),
            "draft": resolve_model_path(models.draft),
            "early_exit_adapter": resolve_model_path(models.early_exit_adapter),
            "eagle_head": resolve_model_path(models.eagle_head),
            "medusa_heads": resolve_model_path(models.medusa_heads),
            "served_model_name": models.served_model_name
            or ("SmolLM2-135M-Instruct" if models.target == "demo:target" else None),
        }
    )


def resolve_model_path(name: str | None) -> str | None:
    """``demo:target`` / ``demo:draft`` / ``demo:eagle`` / ``demo:medusa`` / ``demo:exit`` name what ``specdec demo-models``
    builds."""
    if name is None or not name.startswith("demo:"):
        return name
    from specdec.demo import demo_paths

    role = name.split(":", 1)[1]
    paths = demo_paths()
    if role == "exit":
        from specdec.demo import demo_exit_adapter

        adapter = demo_exit_adapter()
        if adapter is None:
            raise ValueError("demo:exit is not built yet: run `specdec demo-models` first")
        return str(adapter)
    if role not in ("target", "draft", "eagle", "medusa"):
        raise ValueError(f"unknown demo model {name!r}: use demo:target, demo:draft, demo:eagle, demo:medusa "
                         "or demo:exit")
    if not (paths[role] / "config.json").exists() and not any(paths[role].glob("*.json")):
        raise ValueError(f"{name} is not built yet: run `specdec demo-models` first")
    return str(paths[role])


MIB = 1 << 20

# The deployment options the builder (deployments.app) binds when serve_config.yaml's
# ``deployments:`` entries set none; `specdec check-config` reads them from here.
INGRESS_MAX_ONGOING = 256  # the ingress only forwards: the units' limits must apply, not Serve's 5
INGRESS_MAX_QUEUED = 256  # at each proxy, past INGRESS_MAX_ONGOING; then 503
UNIT_MAX_QUEUED = 64  # per caller (each Ingress replica), past the unit's running requests; then 503
RETRY_AFTER_S = 1  # the Retry-After of both refusals
# Serve's default (30 s) is shorter than a restarting worker's model reload under load: the
# health check would fail the whole unit while Ray is already recovering the worker.
UNIT_HEALTH_CHECK_TIMEOUT_S = 60


class RequestLimits(_Strict):
    """What one request may ask of the server, each checked before the work it bounds: the body
    before it is parsed, the prompt's size before it is tokenized. A refusal is a 4xx naming
    the field. The defaults suit a server shared by many clients; raise them for trusted ones."""

    max_body_bytes: int = Field(
        4 * MIB, ge=1024, description="Request bodies larger than this get 413 before they are read."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Prompt tokens (after the chat template). None: the model's context "
        "length less one. A prompt whose UTF-8 size alone proves it too long is refused untokenized."
    )
    max_messages: int = Field(256, ge=1, description="Chat messages in one request.")
    max_stop_strings: int = Field(4, ge=0, description="Stop strings per request (OpenAI allows 4).")
    max_stop_chars: int = Field(
        256, ge=1, description="Characters in one stop string: each is searched for in every round's text."
    )
    default_max_tokens: int | None = Field(
        2048, ge=1, description="max_tokens of a chat request that sets none (OpenAI: the rest of the "
        "context): one such request cannot hold a slot for the whole context. None: the rest of the context."
    )
    max_seed: int = Field(
        2**63 - 1, ge=0, le=2**63 - 1, description="A seed must lie in [-max_seed - 1, max_seed] (int64 by default)."
    )


class UnitArgs(_Strict):
    models: ModelConfig
    speculation: SpeculationConfig = SpeculationConfig()
    colocation: Literal["actors", "in_process"] = Field(
        "actors",
        description="actors: target and draft in their own actors on the router's node (the GPU "
        "default, isolates failures); in_process: both in the router (no hop per round; "
        "for CPUs and small models).",
    )
    resources: WorkerResources = WorkerResources()
    max_concurrent_requests: int = Field(
        16, ge=1, description="Requests a unit takes at once (running in its batch or waiting for room)."
    )
    max_num_seqs: int = Field(
        16, ge=1, description="Rows in one batched step. More raises throughput under load and the "
        "time of every step; requests beyond it wait in the unit's queue."
    )
    step_tokens: int = Field(
        512, ge=16, description="Tokens one step may feed the target: long prompts are prefilled in "
        "chunks of what is left, so one long prompt cannot stall every other stream."
    )
    kv_cache_tokens: int | None = Field(
        None, ge=64, description="The KV cache's size in tokens, shared by the unit's requests in blocks of "
        "16 as they grow; None sizes it from the device at the unit's first start (60% of free GPU memory, "
        "10% of RAM) and a restarted worker keeps that size."
    )
    prefix_caching: bool = Field(
        True, description="Share the KV blocks of a prompt prefix an earlier request filled (a system "
        "prompt is prefilled once, not per request); cached blocks are evicted least recently used first."
    )
    warm_up: bool = Field(
        True, description="Before it takes requests, run a short request through plain decoding and every "
        "drafter (then a batch of 8 plainly and one drafting), so the first requests do not pay for building "
        "the models' kernels and the unit's cost "
        "model starts from warm passes (a few seconds on the demo pair on 2 CPU cores)."
    )
    worker_timeout_s: float = Field(
        120.0, gt=0, description="actors: longest the target worker may take over one step before the step fails."
    )
    draft_timeout_s: float = Field(
        10.0, gt=0, description="actors: longest the draft worker may take over one step; past it the step "
        "runs plainly and the worker is replaced (a hung worker is treated like a dead one)."
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for the unit's models. Ray sets a process's threads to the CPUs it "
        "reserved (1 for a 1-CPU bundle); on a CPU node that runs one unit, give it the cores.",
    )
    stream_interval: int = Field(
        1, ge=1, description="A streamed answer leaves the unit in chunks of at least this many tokens "
        "(its first token and its end at once), as SGLang's and vLLM's stream_interval: fewer wake-ups "
        "of the replica's event loop and fewer streamed messages under load, each chunk a little later. "
        "An answer that is not streamed is handed over whole."
    )
    trace_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Share of requests traced (a caller's sampled traceparent wins)."
    )
    trace_trust_incoming: bool = Field(
        True, description="Whether a caller's traceparent decides sampling and parents the request span. "
        "False (callers you do not control): each request starts its own trace, sampled at "
        "trace_sample_ratio, with a link to the caller's span."
    )
    limits: RequestLimits = RequestLimits()


class AppArgs(UnitArgs):
    """``args:`` of the application: the unit's arguments plus the ingress's, and more units."""

    ingress_cpus: float = Field(0.1, ge=0)
    api_keys: list[str] | None = Field(
        None, description="Keys clients must send as 'Authorization: Bearer <key>' on every /v1 route "
        "(SPECDEC_API_KEY adds comma-separated keys from the environment; keep keys out of configs in git)."
    )
    units: list[UnitArgs] = Field(
        default_factory=list, description="More models in this application, one unit each (deployments "
        "SpecRouter-1, SpecRouter-2, ...), routed by the request's `model`; the top-level unit is the first."
    )
    ingress: Literal["separate", "in_unit"] = Field(
        "separate", description="separate: an Ingress deployment takes HTTP and streams each request from "
        "its unit over Ray (a hop per streamed event; several units and models, the proxy's load spread "
        "over Ingress replicas). in_unit: the unit's own replica (deployment SpecRouter) serves the API, "
        "one model and no hop per event: on 2 CPU cores that hop and the Ingress process cost ~2 ms of "
        "CPU per token, ~10% of the unit's throughput under load (README). Its replicas admit "
        "max_concurrent_requests + 64 requests each, then answer 503 + Retry-After themselves."
    )

    @model_validator(mode="after")
    def _in_unit_serves_one_unit(self) -> "AppArgs":
        if self.ingress == "in_unit" and self.units:
            raise ValueError("ingress: in_unit serves one unit's model; more units need ingress: separate")
        return self

    @model_validator(mode="after")
    def _one_unit_per_name(self) -> "AppArgs":
        seen: set[str] = set()
        for unit in [self, *self.units]:
            clash = seen & set(unit.models.names)
            if clash:
                raise ValueError(f"model name {sorted(clash)[0]!r} is served by two units: names must be unique")
            seen |= set(unit.models.names)
        return self


def unit_fingerprint(models: ModelConfig, speculation: SpeculationConfig, flags: BaseModel) -> str:
    """The ``system_fingerprint`` a unit answers with: the models' (the build, the dtype, the
    model configuration) plus a hash of how it speculates and the operator's live flags, so
    that during a rolling upgrade each response says which configuration produced it.

    >>> a = unit_fingerprint(ModelConfig(target="t"), SpeculationConfig(), SpeculationConfig())
    >>> a.startswith(ModelConfig(target="t").fingerprint + "-")
    True
    >>> a == unit_fingerprint(ModelConfig(target="t"), SpeculationConfig(mode="off"), SpeculationConfig())
    False
    """
    digest = hashlib.sha256((speculation.model_dump_json() + flags.model_dump_json()).encode()).hexdigest()[:6]
    return f"{models.fingerprint}-{digest}"


def router_name(index: int) -> str:
    """The deployment of the application's ``index``-th unit (0: the top-level one)."""
    return "SpecRouter" if index == 0 else f"SpecRouter-{index}"
