"""The unit's model workers: Ray actors the router starts in its own placement group.

Each worker holds one model on its token pool. The router's step loop owns every request's
token ids and the pool layout; a call carries each row's new tokens (``deployments.contexts``:
the worker keeps the contexts it was sent, a restarted one is sent them whole), and a worker
reconciles its cache with the ids (``specdec.batch.runner``), so a restarted worker simply
re-prefills. A step costs
ONE call per worker for the whole batch: the DraftWorker drafts for every ``draft`` row, and
its result travels to the TargetWorker as an object reference, worker to worker, never
through the router; the TargetWorker drafts the rows of the drafters that live on the target
(early exit, EAGLE), verifies every row, and reports its own compute times.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from deployments.contexts import MissingContext, Receiver, Sender
from specdec import compute, grammar, telemetry
from specdec.config import ModelConfig, SpeculationConfig
from specdec.drafters.base import Drafted, DraftRow
from specdec.engine import load_draft_step, load_target_step, target_tokenizer
from specdec.engine.plan import DraftUnavailable, StepPlan
from specdec.engine.target import StepResult

log = logging.getLogger("ray.serve")


def _setup_process(service: str, trace_sample_ratio: float, torch_threads: int | None) -> None:
    """A worker's process: its tracer, and its CPU threads (Ray gives a 1-CPU actor one)."""
    telemetry.configure_tracing(service, sample_ratio=trace_sample_ratio)
    if torch_threads:
        compute.set_threads(torch_threads)


POOL_SIZES = Path(tempfile.gettempdir()) / "specdec-pools"


def pool_tokens(unit: str, configured: int | None) -> int | None:
    """The unit's KV pool size in tokens: as configured, else what its target measured at the
    unit's first start (remembered on this node, where a restarted worker comes back: its
    placement group bundle stays here), None at that first start. A pool re-measured after a
    restart could come out smaller than the step loop's block table assumes."""
    if configured:
        return configured
    try:
        return int(json.loads((POOL_SIZES / f"{unit}.json").read_text())["tokens"])
    except (OSError, ValueError, KeyError):
        return None


def remember_pool(unit: str, tokens: int) -> None:
    POOL_SIZES.mkdir(parents=True, exist_ok=True)
    (POOL_SIZES / f"{unit}.json").write_text(json.dumps({"tokens": tokens}))


@ray.remote
class TargetWorker:
    def __init__(
        self,
        models: ModelConfig,
        speculation: SpeculationConfig,
        trace_sample_ratio: float = 1.0,
        torch_threads: int | None = None,
        kv_cache_tokens: int | None = None,
        unit: str | None = None,
    ):
        _setup_process("specdec-target", trace_sample_ratio, torch_threads)
        size = pool_tokens(unit, kv_cache_tokens) if unit else kv_cache_tokens
        self.target, self._eos = compute.run(load_target_step, models, speculation, target_tokenizer(models), size)
        if unit and size is None:  # the first start measured it: a restart keeps it
            remember_pool(unit, self.target.runner.capacity)
        self._contexts = Receiver()

    def info(self) -> dict:
        return {"max_length": self.target.max_length, "eos_token_ids": self._eos,
                "capacity_tokens": self.target.runner.capacity, "prefix_grid": self.target.runner.prefix_grid}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def score(self, ids: list[int], n: int):
        """``TargetStep.score``: the logits of the last ``n`` tokens of ``ids`` (echo, the quality guard)."""
        return compute.run(self.target.score, ids, n)

    def step(self, plan: StepPlan, bases: dict[str, tuple[int, int]], external: Drafted | None, release: list[str]) -> StepResult:
        """``plan``'s rows carry their new tokens only (``deployments.contexts``)."""
        plan = StepPlan(self._contexts.restore(plan.rows, bases, release))
        return compute.run(self.target.run, plan, external, release)


@ray.remote
class DraftWorker:
    def __init__(self, models: ModelConfig, speculation: SpeculationConfig, target_info: list,
                 trace_sample_ratio: float = 1.0, torch_threads: int | None = None):
        """``target_info``: ``[ref]`` to the TargetWorker's ``info()`` (wrapped, so that Ray does
        not wait for it before starting this process): the draft's pool is the target's size."""
        _setup_process("specdec-draft", trace_sample_ratio, torch_threads)
        info = ray.get(target_info[0])
        self.draft = compute.run(load_draft_step, models, speculation, info["capacity_tokens"])
        grammar.configure(target_tokenizer(models), sorted(info["eos_token_ids"]))  # drafts stay inside grammars
        self._contexts = Receiver()

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def propose(self, rows: list[DraftRow], bases: dict[str, tuple[int, int]], release: list[str]) -> Drafted:
        """``rows`` carry their new tokens only (``deployments.contexts``)."""
        for key in release:
            grammar.release(key)
        return compute.run(self.draft.propose, self._contexts.restore(rows, bases, release), release)


class RemoteTarget:
    """The step loop's target side over a TargetWorker (one call per step).

    A worker that dies mid-step is restarted by Ray (``max_restarts=-1``) and the step is sent
    again, every context whole (a call carries only new tokens while the worker holds the
    rest): the new worker re-prefills and the requests go on token for token (round seeds
    make sampling resume exactly too).
    """

    def __init__(self, actor, max_length: int | None, timeout_s: float | None = None, restarts: int = 3):
        self.actor = actor
        self.max_length = max_length
        self.timeout_s = timeout_s
        self.restarts = restarts
        self.resumed = 0  # steps sent again after the worker died
        self.contexts = Sender()

    def run(self, plan: StepPlan, external, release) -> StepResult:
        # ``external`` may be the DraftWorker's pending result: its ObjectRef goes to the
        # target worker directly, once it is known to arrive in time.
        draft_side = external.source if isinstance(external, PendingDraft) else None
        if isinstance(external, PendingDraft):
            external = external.ref_in_time()
        for attempt in range(self.restarts + 1):
            rows, bases = self.contexts.cut(plan.rows, release)
            try:
                result = ray.get(self.actor.step.remote(StepPlan(rows), bases, external, list(release)),
                                 timeout=self.timeout_s)
            except (RayError, MissingContext) as exc:
                self.contexts.forget()
                if isinstance(external, ray.ObjectRef) and _failed(external):
                    if draft_side is not None:
                        draft_side.lost()
                    raise DraftUnavailable("the draft worker did not deliver its proposals") from None
                if not isinstance(exc, (RayActorError, MissingContext)) or attempt == self.restarts:
                    raise
                if isinstance(exc, RayActorError):
                    log.warning("the target worker died mid-step; waiting for its restart to resume")
                    self._wait_alive()
                    self.resumed += 1
                continue  # a restarted worker: every context whole
            self.contexts.sent(plan.rows)
            return result
        raise AssertionError("unreachable")

    def score(self, ids: list[int], n: int):
        """The worker's ``TargetStep.score``."""
        return ray.get(self.actor.score.remote(ids, n), timeout=self.timeout_s)

    def _wait_alive(self) -> None:
        deadline = time.monotonic() + (self.timeout_s or 120.0)
        while True:
            try:
                ray.get(self.actor.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


class PendingDraft:
    """A DraftWorker's result on its way (``RemoteDraft.propose``)."""

    def __init__(self, ref: ray.ObjectRef, source: "RemoteDraft"):
        self.ref, self.source = ref, source

    def ref_in_time(self) -> ray.ObjectRef:
        return self.source.wait(self.ref)


class RemoteDraft:
    """The step loop's draft side over a DraftWorker: returns at once, never waits.

    A worker that does not deliver within ``timeout_s`` costs that step its drafts (it runs
    plainly), and no proposal is sent until the worker shows it is back: the late proposal
    itself arriving (a slow worker, e.g. a restarted one warming up), or, after a death, a
    readiness probe answering (a call to a restarting actor would wait for it, and every step
    with it). Meanwhile steps run plainly at full speed. A worker silent for ``4 * timeout_s``
    is hung: it is killed, and Ray restarts it.
    """

    def __init__(self, actor, timeout_s: float = 10.0, sizing: ray.ObjectRef | None = None):
        self.actor = actor
        self.timeout_s = timeout_s
        self.sizing = sizing  # what the worker sized its pool from: kept for its restarts
        self.contexts = Sender()  # counted as delivered when sent; any failure resets it
        self._probe: ray.ObjectRef | None = None  # while drafting waits for the worker: what it waits on
        self._since = 0.0  # when it began waiting
        self._killed = False

    def _wait_for(self, ref: ray.ObjectRef) -> None:
        self._probe, self._since = ref, time.monotonic()

    def available(self) -> bool:
        """Whether the worker takes proposals (False while drafting waits for it)."""
        if self._probe is None:
            return True
        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            if not self._killed and time.monotonic() - self._since > 4 * self.timeout_s:
                log.warning("the draft worker is hung (%.0f s without an answer): replacing it",
                            time.monotonic() - self._since)
                ray.kill(self.actor, no_restart=False)
                self._killed = True
                self._wait_for(self.actor.ready.remote())
            return False
        try:
            ray.get(self._probe)
        except RayError:  # it died (again): wait for its restart
            self._wait_for(self.actor.ready.remote())
            return False
        log.info("the draft worker answers again: drafting resumes")
        self._probe, self._killed = None, False
        return True

    def propose(self, rows, release) -> PendingDraft:
        if not self.available():
            raise DraftUnavailable("the draft worker is not back yet")
        wire, bases = self.contexts.cut(rows, release)
        self.contexts.sent(rows)
        return PendingDraft(self.actor.propose.remote(wire, bases, list(release)), self)

    def lost(self) -> None:
        """Its proposals failed (the worker died): wait for Ray's restart, sending nothing."""
        self.contexts.forget()
        if self._probe is None:
            log.warning("the draft worker died; drafts run plainly until its restart answers")
            self._wait_for(self.actor.ready.remote())

    def wait(self, ref: ray.ObjectRef) -> ray.ObjectRef:
        ready, _ = ray.wait([ref], timeout=self.timeout_s)
        if ready:
            return ref
        self.contexts.forget()
        if self._probe is None:
            log.warning("the draft worker did not answer in %.1f s; drafts run plainly until it does",
                        self.timeout_s)
            self._wait_for(ref)  # its late answer says it is back
        raise DraftUnavailable(f"the draft worker did not answer in {self.timeout_s} s")


def _failed(ref: ray.ObjectRef) -> bool:
    """Whether a finished object reference holds an error."""
    try:
        ray.get(ref, timeout=0)
        return False
    except GetTimeoutError:  # not finished: the target failed first
        return False
    except RayError:
        return True
