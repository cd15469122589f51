"""The unit's model workers: Ray actors the router starts in its own placement group.

Each worker holds one model and a KV cache per request id; the router sends the full token
ids on every call and the runner reconciles (DESIGN.md), so a restarted worker simply
re-prefills. The draft's proposal (with its ``q`` rows when sampling) travels to the target
as an object reference, straight from worker to worker, never through the router.
"""

from __future__ import annotations

import ray
import torch

from specdec import telemetry
from specdec.config import ModelConfig
from ray.exceptions import GetTimeoutError, RayError

from specdec.decoding import DraftUnavailable, verify_round
from specdec.drafters.base import Proposal
from specdec.drafters.early_exit import load_early_exit
from specdec.drafters.model import ModelDrafter
from specdec.engine import eos_token_ids
from specdec.runner import ModelRunner, load_model, load_tokenizer
from specdec.sampling import SamplingParams
from specdec.verify import Verdict


def _setup_process(service: str, trace_sample_ratio: float, torch_threads: int | None) -> None:
    """A worker's process: its tracer, and its CPU threads (Ray gives a 1-CPU actor one)."""
    telemetry.configure_tracing(service, sample_ratio=trace_sample_ratio)
    if torch_threads:
        torch.set_num_threads(torch_threads)


@ray.remote
class TargetWorker:
    def __init__(
        self,
        models: ModelConfig,
        trace_sample_ratio: float = 1.0,
        early_exit_threshold: float = 0.0,
        torch_threads: int | None = None,
    ):
        _setup_process("specdec-target", trace_sample_ratio, torch_threads)
        model = load_model(models.target, models.dtype, models.device)
        self.runner = ModelRunner(model)
        self._eos = eos_token_ids(load_tokenizer(models.target), model)
        # Early exit drafts with the target's own first layers on the target's cache: here.
        self.early_exit = None
        if models.early_exit_adapter or models.early_exit_layer is not None:
            self.early_exit = load_early_exit(
                self.runner, models.early_exit_layer, models.early_exit_adapter, threshold=early_exit_threshold
            )

    def info(self) -> dict:
        return {"max_length": self.runner.max_length, "eos_token_ids": self._eos}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def verify(
        self,
        seq_id: str,
        context: list[int],
        proposal: Proposal,
        params: SamplingParams,
        seed: int,
        trace: dict | None = None,
    ) -> Verdict:
        with telemetry.worker_span("verify", trace, {"specdec.k": len(proposal)}) as span:
            verdict = verify_round(self.runner, seq_id, context, proposal, params, seed)
            span.set_attribute("specdec.accepted", verdict.num_accepted)
            return verdict

    def propose_early_exit(
        self,
        seq_id: str,
        context: list[int],
        k: int,
        params: SamplingParams,
        seed: int,
        trace: dict | None = None,
    ) -> Proposal:
        with telemetry.worker_span("draft", trace, {"specdec.k": k, "specdec.mode": "early_exit"}):
            return self.early_exit.propose(seq_id, context, k, params, seed)

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)


@ray.remote
class DraftWorker:
    def __init__(self, models: ModelConfig, trace_sample_ratio: float = 1.0, torch_threads: int | None = None):
        _setup_process("specdec-draft", trace_sample_ratio, torch_threads)
        self.drafter = ModelDrafter(ModelRunner(load_model(models.draft, models.draft_dtype, models.device)))

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def propose(
        self,
        seq_id: str,
        context: list[int],
        k: int,
        params: SamplingParams,
        seed: int,
        trace: dict | None = None,
    ) -> Proposal:
        with telemetry.worker_span("draft", trace, {"specdec.k": k}):
            return self.drafter.propose(seq_id, context, k, params, seed)

    def release(self, seq_id: str) -> None:
        self.drafter.release(seq_id)


class RemoteTarget:
    """``specdec.decoding.Target`` over a TargetWorker actor (called from a router thread)."""

    def __init__(self, actor, max_length: int | None):
        self.actor = actor
        self.max_length = max_length

    def verify(self, seq_id, context, proposal, params, seed) -> Verdict:
        # ``proposal`` may be an ObjectRef from the DraftWorker: Ray hands it to the target
        # worker directly.
        try:
            ref = self.actor.verify.remote(seq_id, context, proposal, params, seed, trace=telemetry.inject())
            return ray.get(ref)
        except RayError:
            if isinstance(proposal, ray.ObjectRef) and _failed(proposal):
                raise DraftUnavailable("the draft worker did not deliver its proposal") from None
            raise

    def release(self, seq_id: str) -> None:
        self.actor.release.remote(seq_id)


def _failed(ref: ray.ObjectRef) -> bool:
    """Whether a finished object reference holds an error."""
    try:
        ray.get(ref, timeout=0)
        return False
    except GetTimeoutError:  # not finished: the target failed first
        return False
    except RayError:
        return True


class RemoteDrafter:
    """``specdec.drafters.base.Drafter`` over a worker actor's propose method.

    ``propose`` returns the ObjectRef of the proposal without waiting for it: the target
    worker resolves it, so a round costs the router one wait. ``draft`` proposes in the
    DraftWorker; ``early_exit`` in the TargetWorker, whose cache it shares.
    """

    def __init__(self, actor, name: str = "draft", method: str = "propose"):
        self.actor = actor
        self.name = name
        self._propose = getattr(actor, method)

    def propose(self, seq_id, context, k, params, seed):
        return self._propose.remote(seq_id, context, k, params, seed, trace=telemetry.inject())

    def observe(self, seq_id: str, proposed: int, accepted: int) -> None:
        pass

    def release(self, seq_id: str) -> None:
        self.actor.release.remote(seq_id)
