"""The unit's step loop: one thread runs every request, one batched step at a time.

    admit   : waiting requests get a pool range (prompt + max_tokens + k_max + 1 tokens) while
              the token budget and ``max_num_seqs`` allow; a request that does not fit waits
    plan    : prefill chunks under the per-step token budget; decode rows, each with its k
              (its policy's choice, trimmed by the goodput rule for the whole step)
    draft   : prompt lookup here; the draft model in one batched call (the draft worker);
              early exit inside the target's call
    verify  : ONE target forward over every row, verification of the whole batch
    commit  : each request's tokens, text and round statistics to its own queue

Requests see none of this: ``submit`` returns a ``Handle`` that yields ``Event``s. A cancelled
handle leaves the batch at the next step and frees its range. Cache keys are made here, never
taken from a client. Every request's randomness comes from ``round_seed`` (request seed,
round, role), so it does not depend on what it is batched with.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from specdec.batch.cache import RangeAllocator
from specdec.batch.drafters import DraftRow, propose_ngram
from specdec.batch.runner import BatchRow
from specdec.batch.schedule import Candidate, StepCosts, allocate
from specdec.batch.target import StepResult, TargetRow
from specdec.drafters.base import EMPTY_PROPOSAL
from specdec.decoding import (
    DRAFT, DRAFT_RETRY_ROUNDS, TARGET, DraftUnavailable, RoundStats, cut_round, draft_budget, round_seed,
)
from specdec.policy import CostModel, ModeSwitch, PolicyConfig, SpeculationPolicy
from specdec.sampling import SamplingParams, make_generator
from specdec.text import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """One request, validated and defaulted once (``Engine.request`` builds it)."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    mode: str = "off"  # resolved: "off", "auto" or a drafter's name
    k: int | None = None  # an explicit k (with a named mode: exactly that k, capped at k_max)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # EOS does not end the request (stop_token_ids still do)
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the request, kept in the output
    min_tokens: int = 0  # no stop token or stop string ends the request before this many tokens


@dataclass
class Event:
    """One round's output as text and ids; ``finish_reason`` is set on the last event."""

    text: str
    token_ids: list[int]
    stats: RoundStats
    finish_reason: str | None = None
    policy_summary: dict | None = None  # the speculation controller's summary, on the last event
    policy_events: list[str] = field(default_factory=list)  # decisions taken before this round
    error: str | None = None  # the unit failed this request (no stats then)
    queued_s: float | None = None  # on the first event: from submit to admission into the batch


class Handle:
    """A submitted request: iterate for its events; ``cancel()`` to stop it."""

    def __init__(self, key: str):
        self.key = key
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.events.get()
            if event.error is not None:
                raise RuntimeError(event.error)
            yield event
            if event.finish_reason:
                return


@dataclass
class _Live:
    """A request in the unit."""

    req: GenerationRequest
    handle: Handle
    seed: int
    start: int = 0
    capacity: int = 0
    prefilled: int = 0  # prompt tokens already in the target's cache (chunked prefill)
    out: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)
    policy: SpeculationPolicy | None = None
    text: TextStream | None = None
    draft_retry_at: int = 0
    events_sent: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    queued_s: float | None = None  # submit to admission: how long it waited for a KV range and a seat

    @property
    def key(self) -> str:
        return self.handle.key

    @property
    def ids(self) -> list[int]:
        return self.req.prompt_ids + self.out


@dataclass
class _Plan:
    live: _Live
    mode: str  # "prefill", "off" or the drafter's name
    k: int
    draft_error: str | None = None  # its drafter failed this step: it ran as a plain row


class StepLoop:
    """The unit's scheduler and loop (module docstring).

    ``target``: ``run(rows, chunks, external, release) -> StepResult`` (a ``TargetStep``, or
    a worker behind it); ``draft``: ``propose(rows, release)`` -> a ``DraftResult`` or a
    handle to one that ``target.run`` resolves (None without a draft model); ``modes``: the
    speculation modes available (``draft``, ``ngram``, ``early_exit``, ``eagle``).
    """

    def __init__(self, target, draft, modes: list[str], *, tokenizer, eos_token_ids: frozenset[int],
                 capacity_tokens: int, max_num_seqs: int = 16, step_tokens: int = 512,
                 policy: Callable[[], PolicyConfig] = PolicyConfig, ngram: tuple[int, int] = (1, 4),
                 default_k: int = 4, max_length: int | None = None):
        self.target, self.draft, self.modes = target, draft, list(modes)
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.allocator = RangeAllocator(capacity_tokens)
        self.max_num_seqs, self.step_tokens = max_num_seqs, step_tokens
        self.policy_config, self.ngram, self.default_k = policy, ngram, default_k
        self.max_length = max_length
        self.costs = StepCosts()
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._release: list[tuple[str, str]] = []  # (side, key) the workers may forget (sent with the next call)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0

    # --- the outside ----------------------------------------------------------------------

    def check_fits(self, req: GenerationRequest) -> None:
        """Refuse a request that could never be admitted (it would wait forever)."""
        need = self._need(req)
        if need > self.allocator.capacity:
            raise ValueError(
                f"the request needs {need} KV cache tokens (prompt + max_tokens + drafts); "
                f"this unit holds {self.allocator.capacity}"
            )

    def submit(self, req: GenerationRequest) -> Handle:
        self.check_fits(req)
        seed = req.params.seed if req.params.seed is not None else int(make_generator(None).initial_seed())
        live = _Live(req, Handle(uuid.uuid4().hex), seed)
        live.policy = self._new_policy(req)
        live.text = TextStream(self.tokenizer, stop=list(req.stop), min_tokens=req.min_tokens)
        with self._cv:
            if self._closed:
                raise RuntimeError("the unit is shutting down")
            self._waiting.append(live)
            self._ensure_thread()
            self._cv.notify()
        return live.handle

    @property
    def active(self) -> int:
        """Requests admitted or waiting: the load the unit carries."""
        return len(self._running) + len(self._waiting)

    def usage(self) -> dict:
        """What the unit holds now (for tests and operators). ``orphans``: sequences a local
        model still caches that belong to no running request and are not due for release
        (None when the models are in worker actors)."""
        return {"running": len(self._running), "waiting": len(self._waiting), "steps": self.steps,
                "free_tokens": self.allocator.free_tokens, "capacity_tokens": self.allocator.capacity,
                "orphans": self._orphans()}

    def _orphans(self) -> int | None:
        runners = {"target": getattr(self.target, "runner", None),
                   "draft": getattr(getattr(self.draft, "drafter", None), "runner", None)}
        if runners["target"] is None:
            return None
        with self._cv:
            owned = {lv.key for lv in self._running}
            due = set(self._release)
        return sum(1 for side, runner in runners.items() if runner is not None
                   for key in runner.keys() if key not in owned and (side, key) not in due)

    def check_alive(self) -> None:
        """Raise if requests are waiting and the loop thread has died."""
        if (self._running or self._waiting) and (self._thread is None or not self._thread.is_alive()):
            raise RuntimeError("the step loop is not running")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # --- the thread -------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="specdec-step-loop", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._running or self._waiting or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception:  # one request's failure must not fail the batch it shares
                log.exception("step failed; running each request alone to find the culprit")
                self._isolate()

    def _need(self, req: GenerationRequest) -> int:
        k_max = self.policy_config().k_max if req.mode != "off" else 0
        return len(req.prompt_ids) + req.max_tokens + k_max + 1

    def _new_policy(self, req: GenerationRequest) -> SpeculationPolicy | None:
        if req.mode == "off":
            return None
        modes = self.modes if req.mode == "auto" else [req.mode]
        seeded = req.params.seed is not None and not req.params.greedy
        cfg = self.policy_config()
        return SpeculationPolicy(
            switch=ModeSwitch({m: None for m in modes}),
            # A seeded sampling request decides on priors alone: which tokens rejection
            # sampling draws depends on how its rounds are cut, so its cuts must not depend
            # on timings or on what it is batched with.
            costs=CostModel(frozen=True) if seeded else self.costs,
            config=self.policy_config,
            k_request=req.k or self.default_k,
            adaptive=cfg.adaptive and (req.k is None or req.mode == "auto"),
        )

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        self._admit()
        for live in [lv for lv in self._running if lv.handle.cancelled.is_set()]:
            self._finish(live, cancelled=True)
        if self._running:
            self._step(list(self._running))

    def _isolate(self) -> None:
        """After a failed step: one step per request alone; those that fail alone get the error."""
        for live in list(self._running):
            try:
                self._step([live])
            except Exception as exc:
                log.exception("request %s failed", live.key)
                self._finish(live, error=f"internal error: {type(exc).__name__}")

    def _step(self, lives: list[_Live]) -> None:
        self.steps += 1
        plans, chunks = self._plan(lives)
        started_at = time.time()
        rows, draft_rows = self._target_rows(plans)
        draft_s, draft_steps = 0.0, 0
        external = None
        if draft_rows and self.draft is not None:
            t0 = time.perf_counter()
            external = self.draft.propose(draft_rows, self._take_release("draft"))
            draft_s = time.perf_counter() - t0  # a local draft has run; a remote one reports its own
        try:
            result = self.target.run(rows, chunks, external, self._take_release("target"))
        except DraftUnavailable as exc:
            log.warning("draft worker failed (%s); this step's drafts run plainly", exc)
            for p in plans:
                if p.mode == "draft":
                    p.live.draft_retry_at = len(p.live.rounds) + DRAFT_RETRY_ROUNDS
            rows = [r if r.source != "external" else _plain(r) for r in rows]
            result = self.target.run(rows, chunks, None, [])
            for p in plans:
                if p.mode == "draft":
                    p.mode, p.k, p.draft_error = "off", 0, f"{type(exc).__name__}: {exc}"
        draft_s = result.draft_s.get("draft", draft_s)
        draft_steps = result.draft_steps.get("draft", max((p.k for p in plans if p.mode == "draft"), default=0))
        self._observe_costs(plans, result, draft_s, draft_steps)
        for plan, verdict, proposal in zip(plans, result.verdicts, result.proposals):
            mode_s = draft_s if plan.mode == "draft" else result.draft_s.get(plan.mode, 0.0)
            self._commit(plan, verdict, len(proposal), mode_s, result.verify_s, started_at)
        for chunk in chunks:
            live = next(lv for lv in self._running if lv.key == chunk.key)
            live.prefilled = len(chunk.ids)

    def _admit(self) -> None:
        with self._cv:
            while self._waiting and len(self._running) < self.max_num_seqs:
                live = self._waiting[0]
                if live.handle.cancelled.is_set():
                    self._waiting.popleft()
                    continue
                need = self._need(live.req)
                start = self.allocator.allocate(need)
                if start is None:
                    break  # wait for room: requests leave the unit in order of arrival
                self._waiting.popleft()
                live.start, live.capacity = start, need
                live.queued_s = time.perf_counter() - live.submitted
                self._running.append(live)

    def _plan(self, lives: list[_Live]) -> tuple[list[_Plan], list[BatchRow]]:
        """Decode rows (each with its k) and prefill chunks for this step."""
        decode = [lv for lv in lives if lv.prefilled >= len(lv.req.prompt_ids) or lv.rounds]
        prefilling = [lv for lv in lives if lv not in decode]
        budget = max(1, self.step_tokens - len(decode))
        plans, chunks = [], []
        for live in prefilling:  # oldest first; a prompt that fits finishes its prefill as a row
            rest = len(live.req.prompt_ids) - live.prefilled
            if rest <= budget:
                plans.append(_Plan(live, "prefill", 0))
                budget -= rest
            elif budget > 0:
                chunks.append(BatchRow(live.key, live.req.prompt_ids[: live.prefilled + budget], 0,
                                       live.start, live.capacity))
                budget = 0
        other = sum(len(c.ids) - self._prefilled_of(c.key) for c in chunks)
        other += sum(len(p.live.req.prompt_ids) - p.live.prefilled for p in plans)
        cands, decode_plans = [], []
        cfg = self.policy_config()
        for live in decode:
            cand = self._candidate(live, cfg)
            decode_plans.append(_Plan(live, cand.mode, 0))
            cands.append(cand)
        # A lone row keeps its policy's k (the same costs, one request); a batch shares a step.
        ks = allocate(cands, self.costs, other) if len(cands) > 1 else [c.k_cap for c in cands]
        for plan, k in zip(decode_plans, ks):
            plan.k = k
            if k == 0:
                plan.mode = "off"
        return plans + decode_plans, chunks

    def _prefilled_of(self, key: str) -> int:
        return next((lv.prefilled for lv in self._running if lv.key == key), 0)

    def _candidate(self, live: _Live, cfg: PolicyConfig) -> Candidate:
        """This row's policy decision: its mode, its most k, and whether k is fixed."""
        policy = live.policy
        remaining = live.req.max_tokens - len(live.out)
        index = len(live.rounds)
        if policy is None or cfg.kill_switch or index < live.draft_retry_at:
            if policy is not None:
                policy._update(live.rounds, cfg)  # keep its estimates current
            return Candidate(0.0, 0, "off", fixed=True)
        k = draft_budget(min(policy(live.rounds), cfg.k_max), remaining)
        mode = policy.switch.active
        a = policy.acceptance.get(mode, cfg.prior_acceptance)
        seeded = live.req.params.seed is not None and not live.req.params.greedy
        fixed = seeded or policy.probing or not policy.adaptive
        return Candidate(a, k, mode, fixed=fixed)

    def _target_rows(self, plans: list[_Plan]) -> tuple[list[TargetRow], list[DraftRow]]:
        rows, draft_rows = [], []
        ngram = [p for p in plans if p.mode == "ngram" and p.k]
        lookups = propose_ngram([DraftRow(p.live.key, p.live.ids, p.k, p.live.req.params, 0) for p in ngram],
                                *self.ngram)
        by_key = {p.live.key: prop for p, prop in zip(ngram, lookups)}
        for p in plans:
            live, index = p.live, len(p.live.rounds)
            target_seed = round_seed(live.seed, index, TARGET)
            draft_seed = round_seed(live.seed, index, DRAFT)
            base = dict(key=live.key, context=live.ids, params=live.req.params, seed=target_seed,
                        start=live.start, capacity=live.capacity, **self._suppressed(live))
            if p.mode == "ngram" and p.k:
                rows.append(TargetRow(**base, source="given", proposal=by_key[live.key]))
            elif p.mode == "draft" and p.k:
                rows.append(TargetRow(**base, source="external"))
                draft_rows.append(DraftRow(live.key, live.ids, p.k, live.req.params, draft_seed,
                                           live.start, live.capacity))
            elif p.mode in ("early_exit", "eagle") and p.k:  # drafted on the target's side
                rows.append(TargetRow(**base, source=p.mode, k=p.k, draft_seed=draft_seed))
            else:
                rows.append(TargetRow(**base))
        return rows, draft_rows

    def _stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        return req.stop_token_ids if req.ignore_eos else req.stop_token_ids | self.eos_token_ids

    def _suppressed(self, live: _Live) -> dict:
        """min_tokens: the stop tokens the target may not emit, and for how many of this round's
        positions. It is part of the target's distribution p, so verification stays exact."""
        left = live.req.min_tokens - len(live.out)
        return dict(suppress=tuple(sorted(self._stop_ids(live.req))), suppress_for=left) if left > 0 else {}

    def _take_release(self, side: str) -> list[str]:
        keys = [k for s, k in self._release if s == side]
        self._release = [(s, k) for s, k in self._release if s != side]
        return keys

    def _observe_costs(self, plans: list[_Plan], result: StepResult, draft_s: float, draft_steps: int) -> None:
        if result.tokens:
            self.costs.observe_verify(result.tokens, result.verify_s)
        for mode in ("draft", "early_exit", "eagle"):
            rows = sum(1 for p in plans if p.mode == mode)
            seconds = draft_s if mode == "draft" else result.draft_s.get(mode, 0.0)
            steps = draft_steps if mode == "draft" else result.draft_steps.get(mode, 0)
            if rows and steps and seconds > 0:
                self.costs.observe_draft(mode, rows, seconds / steps)

    # --- commit -------------------------------------------------------------------------------

    def _commit(self, plan: _Plan, verdict, drafted: int, draft_s: float, verify_s: float, started_at: float):
        live = plan.live
        if verdict is None:
            raise RuntimeError(f"no verdict for request {live.key}")
        stops = self._stop_ids(live.req)
        tokens, finish = cut_round(verdict.tokens, live.req.max_tokens - len(live.out), stops)
        live.out.extend(tokens)
        index = len(live.rounds)
        stats = RoundStats(
            index=index, mode="prefill" if index == 0 else plan.mode, k=plan.k, drafted=verdict.num_drafted,
            accepted=verdict.num_accepted, emitted=len(tokens), draft_s=draft_s if drafted else 0.0,
            verify_s=verify_s, started_at=started_at, draft_error=plan.draft_error,
        )
        live.rounds.append(stats)
        if index == 0:
            live.prefilled = len(live.req.prompt_ids)
        delta, kept = live.text.add(tokens)
        if live.text.stopped:
            finish = "stop"
        if finish:
            delta += live.text.finish()
        events = []
        if live.policy is not None:
            events = [what for _, what in live.policy.events[live.events_sent:]]
            live.events_sent = len(live.policy.events)
        summary = (live.policy.summary() if live.policy else {}) if finish else None
        live.handle.events.put(Event(delta, kept, stats, finish, summary, events,
                                     queued_s=live.queued_s if index == 0 else None))
        if finish:
            self._finish(live)

    def _finish(self, live: _Live, *, cancelled: bool = False, error: str | None = None) -> None:
        if live in self._running:
            self._running.remove(live)
            self.allocator.free(live.start, live.capacity)
            self._release += [("target", live.key), ("draft", live.key)]
        if error is not None:
            live.handle.events.put(Event("", [], None, "error", error=error))  # type: ignore[arg-type]


def _plain(row: TargetRow) -> TargetRow:
    return dataclasses.replace(row, source="given", proposal=EMPTY_PROPOSAL, k=0, draft_seed=0)
