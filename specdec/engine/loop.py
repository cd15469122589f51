"""The unit's step loop: one thread runs every request, one batched step at a time.

    admit   : waiting requests get KV blocks for their prompt (``specdec.batch.blocks``: the
              full blocks of a prompt prefix another request filled are shared, not prefilled
              again) while blocks and ``max_num_seqs`` allow; one that does not fit yet waits
              without holding back those behind it
    grow    : every running request gets the blocks its next tokens (and drafts) need; when
              none are left the newest request is preempted (its blocks freed, recomputed later
              from its tokens so far) rather than the step failing
    plan    : one ``StepPlan``: prompt chunks under the per-step token budget; decode rows,
              each with its mode and k (its policy's choice, trimmed by the goodput rule for
              the whole step); drafters that run in the loop (prompt lookup) draft here
    draft   : the draft model's rows in one batched call (the draft side); early exit and
              EAGLE inside the target's call
    verify  : ONE target forward over every row, verification of the whole batch
    commit  : each request's tokens, text and round statistics to its own handle

Requests see none of this: ``submit`` returns a ``Handle`` that yields typed events
(``specdec.engine.events``), to a thread or to an asyncio task. A cancelled handle leaves the
batch at the next step and frees its range. Cache keys are made here, never taken from a
client. Every request's randomness comes from ``round_seed`` (request seed, round, role), so
it does not depend on what it is batched with (a preempted seeded request that speculates may
cut its rounds elsewhere when it resumes: the same distribution, other samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import torch

from specdec import compute, grammar
from specdec.batch.attention import PACK_MAX_QUERIES
from specdec.batch.blocks import BLOCK, BlockPool, blocks_for, prefix_hashes
from specdec.batch.numerics import INVARIANT_CHUNK
from specdec.drafters import DRAFTERS
from specdec.drafters.base import EMPTY_PROPOSAL, BatchDrafter
from specdec.engine.events import ErrorEvent, RoundEvent
from specdec.engine.replay import QualityGuard, randomized_pit
from specdec.engine.plan import (
    DRAFT, DRAFT_RETRY_ROUNDS, TARGET, DraftUnavailable, Row, StepPlan, cut_round, draft_budget, round_seed,
)
from specdec.grammar import GrammarSpec
from specdec.engine.schedule import Candidate, GoodputGuard, StepCosts, allocate
from specdec.engine.target import Drafting, StepResult, draft_all, draft_rows
from specdec.policy import DrafterRecord, PolicyConfig, SpeculationPolicy
from specdec.sampling import SamplingParams, logits_to_probs, make_generator, penalize
from specdec.stats import RoundStats
from specdec.text import TextStream

log = logging.getLogger(__name__)

# A seeded sampled row whose draft side failed waits for it (a restarted draft worker answers in
# seconds) rather than change its text; past this it runs plainly, as other rows do at once.
HOLD_SEEDED_S = 30.0
HOLD_POLL_S = 0.05  # a step in which every row waits: how long before the next try
REPLAY_BACKLOG = 256  # quality replays (and sampled answers to score) that may wait for spare capacity
SHADOWED = ("ngram",)  # drafters that cost nothing to ask: every round scores them (``_shadow``)
UNIT_EWMA = 0.05  # weight of one round in the unit's drafter record (``StepLoop.record``): ~20 rounds' memory


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
    logprobs: int | None = None  # report each token's log-probability and this many most likely ones (0-20)
    grammar: GrammarSpec | None = None  # structured output: what the output must match (``specdec.grammar``)
    tag: str | None = None  # what logs name the request by (its trace id), e.g. when its replay differs
    # The operator flags a seeded sampled request runs under (read with the system_fingerprint
    # its answer carries); None: the unit's flags when it is admitted (``StepLoop._new_policy``).
    flags: PolicyConfig | None = None
    # Events reach the reader in batches of at least this many tokens (``Handle``): fewer wake-ups
    # of the reader's thread under load, each streamed chunk a little later (SGLang's and vLLM's
    # ``stream_interval``).
    stream_interval: int = 1


class Handle:
    """A submitted request: iterate (``for`` in a thread, ``async for`` on the event loop it was
    submitted with) for its events; ``cancel()`` to stop it.

    ``interval``: the loop hands events over once at least this many tokens are waiting (the
    first event and the last, or an error, at once), so a reader is woken once per
    ``interval`` tokens, not once per round. The events and their order do not change."""

    def __init__(self, key: str, loop: asyncio.AbstractEventLoop | None = None, interval: int = 1):
        self.key = key
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: queue.Queue | asyncio.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self.interval = max(1, interval)
        self._held: list[RoundEvent] = []  # the loop thread's, until handed over
        self._started = False

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: RoundEvent | ErrorEvent) -> None:
        """From the loop thread."""
        self._held.append(event)
        if self._started and isinstance(event, RoundEvent) and not event.finish_reason \
                and sum(len(e.token_ids) for e in self._held) < self.interval:
            return
        self._started, batch, self._held = True, self._held, []
        if self._loop is None:
            for item in batch:
                self._events.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._hand_over, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancel()

    def _hand_over(self, batch: list) -> None:
        for item in batch:
            self._events.put_nowait(item)

    @staticmethod
    def _check(event: RoundEvent | ErrorEvent) -> RoundEvent:
        if isinstance(event, ErrorEvent):
            raise RuntimeError(event.message)
        return event

    def __iter__(self) -> Iterator[RoundEvent]:
        while True:
            event = self._check(self._events.get())
            yield event
            if event.finish_reason:
                return

    async def __aiter__(self) -> AsyncIterator[RoundEvent]:
        while True:
            event = self._check(await self._events.get())
            yield event
            if event.finish_reason:
                return


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went (seconds): planning with the loop's own drafting, the draft
    side's and the target side's drafting, the target's pass, the whole call to the target
    side (both sides' drafting, the pass, verification), and the step."""

    rows: int
    speculated: bool
    decoding: bool  # no prompt in the step
    tokens: int  # output tokens it emitted
    plan_s: float
    draft_s: float
    verify_s: float
    target_call_s: float
    total_s: float


@dataclass(eq=False)  # identity: a request is itself, not its contents
class _Live:
    """A request in the unit."""

    req: GenerationRequest
    handle: Handle
    seed: int
    policy: SpeculationPolicy | None
    text: TextStream
    blocks: list[int] = field(default_factory=list)  # its block table, while admitted
    named: list[bytes] = field(default_factory=list)  # prefix hashes of its first full blocks
    registered: int = 0  # of its blocks, how many the pool may share (named, filled)
    prefill: list[int] = field(default_factory=list)  # what it prefills: its prompt, or all its ids after a preemption
    prefilled: int = 0  # of those, tokens already in the target's cache (chunked prefill, prefix hits)
    cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache
    preemptions: int = 0
    out: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)
    draft_retry_at: int = 0
    held_since: float = 0.0  # a seeded sampled row waiting for its draft side (``_verify``)
    events_sent: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    queued_s: float | None = None  # submit to admission: how long it waited for a KV range and a seat
    expected: list[int] | None = None  # a quality replay: the tokens the request it replays emitted
    replayed: GenerationRequest | None = None  # ... and that request

    def __post_init__(self) -> None:
        self.prefill = self.prefill or self.req.prompt_ids

    @property
    def key(self) -> str:
        return self.handle.key

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK

    @property
    def ids(self) -> list[int]:
        return self.req.prompt_ids + self.out

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.prefill)


def invariant_chunk(room: int) -> int:
    """The prompt chunk of batch-invariant numerics for ``room`` tokens a step: ``INVARIANT_CHUNK``
    or the largest power-of-two number of blocks under it that fits, at least one block (it
    divides ``INVARIANT_CHUNK``, the grid prefixes are shared on).

    >>> invariant_chunk(496), invariant_chunk(100), invariant_chunk(0)
    (128, 64, 16)
    """
    chunk = INVARIANT_CHUNK
    while chunk > BLOCK and chunk > room:
        chunk //= 2
    return chunk


class StepLoop:
    """The unit's scheduler and loop (module docstring).

    ``target``: ``run(plan, external, release) -> StepResult`` (a ``TargetStep``, or a worker
    behind it); ``draft``: ``propose(rows, release)`` -> ``Drafted`` or a handle to one that
    ``target.run`` resolves (None without a draft model); ``loop_drafters``: the drafters that
    run here (prompt lookup); ``modes``: every drafter the unit offers.
    """

    def __init__(self, target, draft, modes: list[str], *, tokenizer, eos_token_ids: frozenset[int],
                 capacity_tokens: int, max_num_seqs: int = 16, step_tokens: int = 512,
                 policy: Callable[[], PolicyConfig] = PolicyConfig,
                 loop_drafters: dict[str, BatchDrafter] | None = None,
                 default_k: int = 4, max_length: int | None = None, tree_width: int = 6,
                 fixed_chunks: bool = False, prefix_caching: bool = True, prefix_grid: int | None = None):
        self.target, self.draft, self.modes = target, draft, list(modes)
        self.loop_drafters = dict(loop_drafters or {})
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.blocks = BlockPool(capacity_tokens // BLOCK + 1, caching=prefix_caching)  # the runners' pools' size
        self.max_num_seqs, self.step_tokens = max_num_seqs, step_tokens
        self.policy_config, self.default_k, self.tree_width = policy, default_k, tree_width
        self.max_length = max_length
        # Batch-invariant numerics: a prompt is prefilled in chunks of this many tokens at fixed
        # places (what its KV holds then depends on the prompt alone); one always fits a step.
        # A prefix hit ends where a chunk does (what follows it is prefilled in the chunks a
        # whole prefill cuts), unless the target's prompt tokens attend as its decode tokens do
        # (``prefix_grid``: the blocks a hit is a multiple of, ``BatchRunner.prefix_grid``).
        self.chunk = invariant_chunk(step_tokens - max_num_seqs) if fixed_chunks else None
        self.prefix_grid = prefix_grid or (INVARIANT_CHUNK // BLOCK if fixed_chunks else 1)
        self.preempted = 0  # requests preempted (blocks ran out), since the start
        self.hit_tokens = 0  # prompt tokens admitted requests found in the prefix cache, since the start
        self.costs = StepCosts()
        self._shapes: set[tuple] = set()  # the pass shapes timed once (``_observe_costs``)
        # Every drafter's acceptance over all requests' rounds: where a new request's policy starts.
        self.record, self._record_lock = DrafterRecord(), threading.Lock()
        self.guard = GoodputGuard()
        self.timings: deque[StepTiming] = deque(maxlen=4096)  # the last steps, for measurements
        self.quality = QualityGuard()  # replays of finished requests (``specdec.engine.replay``)
        self.on_replay: Callable[[bool, GenerationRequest], None] | None = None  # each replay's outcome
        self.on_quality_trip: Callable[[dict], None] | None = None  # the guard tripped: switch speculation off
        # Waiting for spare capacity; under sustained load the oldest are dropped, not memory.
        self._replays: deque[_Live] = deque(maxlen=REPLAY_BACKLOG)
        self._scores: deque[tuple[GenerationRequest, list[int]]] = deque(maxlen=REPLAY_BACKLOG)  # sampled answers
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._release: list[tuple[str, str]] = []  # (side, key) the workers may forget (sent with the next call)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0
        self.peak_running = 0  # the most requests admitted at once

    # --- the outside ----------------------------------------------------------------------

    def check_fits(self, req: GenerationRequest) -> None:
        """Refuse a request that could never be admitted (it would wait forever)."""
        need = self._need(req)
        if blocks_for(need) * BLOCK > self.blocks.capacity_tokens:
            raise ValueError(
                f"the request needs {need} KV cache tokens (prompt + max_tokens + drafts); "
                f"this unit holds {self.blocks.capacity_tokens}"
            )

    def submit(self, req: GenerationRequest, *, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Queue ``req``; its events go to a thread (``loop=None``) or to asyncio ``loop``."""
        self.check_fits(req)
        seed = req.params.seed if req.params.seed is not None else int(make_generator(None).initial_seed())
        text = TextStream(self.tokenizer, stop=list(req.stop), min_tokens=req.min_tokens)
        live = _Live(req, Handle(uuid.uuid4().hex, loop, req.stream_interval), seed, self._new_policy(req), text)
        with self._cv:
            if self._closed:
                raise RuntimeError("the unit is shutting down")
            self._waiting.append(live)
            self._ensure_thread()
            self._cv.notify()
        return live.handle

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside are admitted in the same step (if they fit): the loop
        cannot take the waiting queue until the block ends (measurements of B rows at once)."""
        with self._cv:
            yield

    @property
    def active(self) -> int:
        """Requests admitted or waiting: the load the unit carries (quality replays are not)."""
        return sum(1 for lv in self._running if lv.expected is None) + len(self._waiting)

    def usage(self) -> dict:
        """What the unit holds now (for tests and operators). ``orphans``: sequences a local
        model still caches that belong to no running request and are not due for release
        (None when the models are in worker actors)."""
        return {"running": len(self._running), "waiting": len(self._waiting), "steps": self.steps,
                "replays": len(self._replays) + sum(1 for lv in self._running if lv.expected is not None),
                "free_tokens": self.blocks.free_blocks * BLOCK, "capacity_tokens": self.blocks.capacity_tokens,
                "cached_tokens": self.blocks.cached_blocks * BLOCK, "prefix_hit_tokens": self.hit_tokens,
                "preempted": self.preempted, "peak_running": self.peak_running, "orphans": self._orphans()}

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
                while not (self._running or self._waiting or self._replays or self._scores or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
            try:
                compute.run(self.step)  # model work runs on the process's one compute thread
            except Exception:  # one request's failure must not fail the batch it shares
                log.exception("step failed; running each request alone to find the culprit")
                compute.run(self._isolate)

    def _need(self, req: GenerationRequest) -> int:
        """The most KV tokens ``req`` can ever hold (its longest answer, and drafts past it)."""
        return len(req.prompt_ids) + req.max_tokens + self._lookahead(req)

    def _lookahead(self, req: GenerationRequest) -> int:
        """Tokens past its ids a request's next step may write: its pending token's slack, drafts."""
        cfg = self.policy_config()
        return (max(cfg.k_max, cfg.tree_nodes) if req.mode != "off" else 0) + 1

    def _new_policy(self, req: GenerationRequest) -> SpeculationPolicy | None:
        if req.mode == "off":
            return None
        seeded = req.params.seed is not None and not req.params.greedy
        # A seeded sampling request decides on priors alone (a cost model nothing observes) and
        # under the flags it was admitted with: which tokens rejection sampling draws depends on
        # how its rounds are cut, so its cuts must not depend on timings, on what it is batched
        # with, or on a flag changed while it runs (its answer is the one the configuration its
        # system_fingerprint names gives). The kill switch still stops its drafting at once.
        admitted = req.flags or self.policy_config()
        with self._record_lock:
            record = DrafterRecord() if seeded else self.record.copy()
        return SpeculationPolicy(
            modes=self.modes if req.mode == "auto" else [req.mode],
            costs=StepCosts() if seeded else self.costs,
            config=(lambda: admitted) if seeded else self.policy_config,
            k_request=req.k or self.default_k,
            adaptive=admitted.adaptive and (req.k is None or req.mode == "auto"),
            tree_modes={m: DRAFTERS[m].tree_of for m in self.modes if DRAFTERS[m].trees},
            tree_width=self.tree_width,
            record=record,
            shadowed=frozenset(SHADOWED) & set(self.loop_drafters),
        )

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        self._admit()
        for live in [lv for lv in self._running if lv.handle.cancelled.is_set()]:
            self._finish(live, cancelled=True)
        self._grow()
        if self._running:
            self._step(list(self._running))
        elif self._scores and not self._waiting:  # spare capacity: check a sampled answer's distribution
            self._score(*self._scores.popleft())

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
        started_at, began = time.time(), time.perf_counter()
        by_key = {lv.key: lv for lv in lives}
        decoding = all(lv.decoding for lv in lives)  # no prompt in this step: its goodput compares
        plan = self._plan(lives, observed=decoding)
        plan, here = self._draft_in_loop(plan)
        planned = time.perf_counter()
        plan, result, errors = self._verify(plan)
        if not plan.rows:  # every row sat the step out (``_verify``)
            return
        verified = time.perf_counter()
        errors = {**errors, **here.errors, **result.draft_errors}
        for key in {**here.errors, **result.draft_errors}:
            by_key[key].draft_retry_at = len(by_key[key].rounds) + DRAFT_RETRY_ROUNDS
        costs = {**here.costs, **result.draft_costs}
        self._observe_costs(plan, result, costs, decoding)
        for row in plan.rows:  # what the target now holds, shared with later prompts (before any leaves)
            self._name_blocks(by_key[row.key], row.context)
        emitting = [r for r in plan.rows if r.emits]
        emitted = 0
        full = result.full or [None] * len(emitting)
        for row, verdict, confidence, leaf in zip(emitting, result.verdicts, result.confidence, full):
            draft_s = costs.get(row.mode, (0.0, 0))[0] if verdict.num_drafted else 0.0
            emitted += self._commit(by_key[row.key], row, verdict, confidence, draft_s, result.verify_s, started_at,
                                    errors.get(row.key), leaf)
        done = time.perf_counter()
        speculated = any(r.k for r in plan.rows)
        if decoding:
            self.guard.observe(len(plan.rows), speculated, tokens=emitted, seconds=done - began)
        self.timings.append(StepTiming(len(plan.rows), speculated, decoding, emitted, planned - began,
                                       sum(s for s, _ in result.draft_costs.values()), result.verify_s,
                                       verified - planned, done - began))
        for row in plan.rows:
            if not row.emits:
                by_key[row.key].prefilled = len(row.context)

    def _admit(self) -> None:
        with self._cv:
            if self._waiting:  # live traffic: quality replays give their places back, to start again later
                for live in [lv for lv in self._running if lv.expected is not None]:
                    self._finish(live, cancelled=True)
                    self._replays.appendleft(self._replay(live.replayed, live.expected))
            self._admit_from(self._waiting)
            if not self._waiting and all(lv.expected is not None for lv in self._running):
                self._admit_from(self._replays)  # spare capacity only

    def _admit_from(self, queue: deque) -> None:
        """Oldest first, each request that fits now; one that does not waits without holding back
        smaller ones behind it. Blocks for one more each are kept free for the running requests'
        next tokens, so admitting does not preempt at once."""
        waiting = []
        while queue and len(self._running) < self.max_num_seqs:
            live = queue.popleft()
            if live.handle.cancelled.is_set():
                continue
            if not self._place(live):
                waiting.append(live)
        queue.extendleft(reversed(waiting))

    def _place(self, live: _Live) -> bool:
        """Blocks for ``live``'s prefill (a shared prefix's from the cache) and its first step."""
        ids = live.prefill
        # The last token is always fed (its logits are the first output), so it is never a hit.
        live.named = prefix_hashes(ids[: len(ids) - 1], start=live.named[: (len(ids) - 1) // BLOCK])
        hits = self.blocks.match(live.named, multiple=self.prefix_grid)
        if self._sharing_a_prefill(live, len(hits)):
            self.blocks.release(hits)
            return False
        need = blocks_for(len(ids) + self._lookahead(live.req)) - len(hits)
        fresh = None
        if need + len(self._running) <= self.blocks.free_blocks:  # right after a hit's blocks if it can: one view
            fresh = self.blocks.allocate(need, after=hits[-1] if hits else None, evict_next=bool(hits))
        if fresh is None:
            self.blocks.release(hits)
            return False
        live.blocks, live.registered, live.prefilled = hits + fresh, len(hits), len(hits) * BLOCK
        self.hit_tokens += live.prefilled
        if live.cached_tokens is None:
            live.cached_tokens = live.prefilled
            live.queued_s = time.perf_counter() - live.submitted
        self._running.append(live)
        self.peak_running = max(self.peak_running, len(self._running))
        return True

    def _sharing_a_prefill(self, live: _Live, hit_blocks: int) -> bool:
        """Whether a running request is prefilling more of ``live``'s prompt than the prefix
        cache holds: ``live`` then waits for those blocks instead of computing them again (the
        choices of one request, concurrent requests with one system prompt). A hit is whole
        chunks under batch-invariant numerics, so only a shared prefix of whole chunks counts."""
        if not self.blocks.caching:
            return False
        multiple = self.chunk // BLOCK if self.chunk and self.prefix_grid > 1 else 1
        for other in self._running:
            if other.decoding or other.expected is not None:
                continue
            common = 0
            for mine, theirs in zip(live.named, other.named):
                if mine != theirs:
                    break
                common += 1
            if common // multiple * multiple > hit_blocks:
                return True
        return False

    def _grow(self) -> None:
        """Every running request's blocks for its next step (oldest first); when the pool runs
        out, the newest request is preempted until the rest fit."""
        for live in list(self._running):
            if live not in self._running:
                continue  # preempted for an older one
            want = blocks_for(len(live.ids) + self._lookahead(live.req)) - len(live.blocks)
            while want > 0:
                more = self.blocks.allocate(want, after=live.blocks[-1] if live.blocks else None)
                if more is not None:
                    live.blocks.extend(more)
                    break
                newest = self._running[-1]
                self._preempt(newest)
                if newest is live:
                    break

    def _preempt(self, live: _Live) -> None:
        """Free ``live``'s blocks; it waits at the head of its queue to prefill all its ids again
        (its filled blocks stay in the prefix cache, so what survives is not recomputed)."""
        log.info("KV blocks ran out: request %s is preempted (%d tokens so far)", live.req.tag or live.key,
                 len(live.ids))
        self._running.remove(live)
        self.blocks.release(live.blocks)
        self._release += [("target", live.key), ("draft", live.key)]
        live.blocks, live.registered, live.prefill, live.prefilled = [], 0, live.ids, 0
        live.preemptions += 1
        self.preempted += 1
        (self._replays if live.expected is not None else self._waiting).appendleft(live)

    def _name_blocks(self, live: _Live, context: list[int]) -> None:
        """The target holds ``context``: its full blocks may be shared from now on (under
        batch-invariant numerics with prompts in causal calls, ``prefix_grid`` > 1, those of
        its prompt only: ``BatchRow.shared_upto``)."""
        upto = min(len(context), len(live.req.prompt_ids)) if self.prefix_grid > 1 else len(context)
        full = min(upto // BLOCK, len(live.blocks))
        if full <= live.registered:
            return
        live.named = prefix_hashes(context[: full * BLOCK], start=live.named[:full])
        for j in range(live.registered, full):
            self.blocks.register(live.blocks[j], live.named[j])
        live.registered = full

    # --- plan ---------------------------------------------------------------------------------

    def _plan(self, lives: list[_Live], observed: bool) -> StepPlan:
        """Prompt rows first (oldest first, under the token budget), then decode rows with their k.
        ``observed``: no prompt is in the step, so the goodput guard will observe it."""
        decode = [lv for lv in lives if lv.decoding]
        budget = max(1, self.step_tokens - len(decode))
        rows, other = [], 0
        for live in (lv for lv in lives if not lv.decoding):
            rest = len(live.prefill) - live.prefilled
            if self.chunk is not None:  # fixed chunks: the next whole one, or wait for a step with room
                take = self._chunk_end(live) - live.prefilled
                if take > budget:
                    continue
                if take < rest:
                    rows.append(self._row(live, emits=False, context=live.prefill[: live.prefilled + take]))
                    budget, other = budget - take, other + take
                    continue
            if rest <= budget:  # a prompt that fits finishes its prefill as an emitting row
                rows.append(self._row(live, emits=True))
                budget, other = budget - rest, other + rest
            elif budget > 0:
                rows.append(self._row(live, emits=False, context=live.prefill[: live.prefilled + budget]))
                other += budget
                budget = 0
        cfg = self.policy_config()
        cands = [self._candidate(live, cfg) for live in decode]
        # A lone row keeps its policy's k (the same costs, one request); a batch shares a step.
        ks = allocate(cands, self.costs, other) if len(cands) > 1 else [c.k_cap for c in cands]
        if len(cands) > 1 and any(k and not c.fixed for c, k in zip(cands, ks)) \
                and not self.guard.allow(len(cands), observed=observed):
            ks = [c.k_cap if c.fixed else 0 for c in cands]  # speculating measurably loses at this load
        for live, c, k in zip(decode, cands, ks):
            stop = live.policy.stop_below(c.mode) if k and live.policy is not None else 0.0
            rows.append(self._row(live, mode=c.mode if k else "off", k=k, stop_below=stop))
        return StepPlan(rows)

    def _chunk_end(self, live: _Live) -> int:
        """Batch-invariant numerics: where the next piece of ``live``'s prefill ends. Its prompt
        in chunks at multiples of ``self.chunk`` (the last ends with the prompt); after a
        preemption, the tokens it had generated in pieces of at most ``PACK_MAX_QUERIES``, whose
        every query attends alone as a decode step's did: their keys and values come out as
        they were (a chunk over them rounds otherwise: the answer could change)."""
        at, prompt = live.prefilled, len(live.req.prompt_ids)
        if at < prompt:
            return min(prompt, (at // self.chunk + 1) * self.chunk)
        return min(len(live.prefill), at + PACK_MAX_QUERIES)

    def _row(self, live: _Live, *, emits: bool = True, context: list[int] | None = None, mode: str = "off",
             k: int = 0, stop_below: float = 0.0) -> Row:
        index = len(live.rounds)
        context = context if context is not None else live.ids
        nodes, price = 0, None
        if k and DRAFTERS[mode].trees:  # the tree's budget; the range holds max(k_max, tree_nodes) + 1 more
            nodes = max(0, min(live.policy.config().tree_nodes, live.capacity - len(context) - 1))
            price = live.policy.node_price(mode, k, nodes)
        return Row(live.key, context, tuple(live.blocks), emits, mode=mode, k=k, stop_below=stop_below,
                   nodes=nodes, price=price, params=live.req.params, target_seed=round_seed(live.seed, index, TARGET),
                   draft_seed=round_seed(live.seed, index, DRAFT), prompt_len=len(live.req.prompt_ids),
                   logprobs=live.req.logprobs, grammar=live.req.grammar, **self._suppressed(live))

    def _candidate(self, live: _Live, cfg: PolicyConfig) -> Candidate:
        """This row's policy decision: its mode, its most k, and whether k is fixed."""
        policy = live.policy
        if policy is None:
            return Candidate(0.0, 0, "off", fixed=True)
        kill_switch, cfg = cfg.kill_switch, policy.config()  # the request's flags (``_new_policy``)
        if kill_switch or len(live.rounds) < live.draft_retry_at:
            policy.observe(live.rounds)  # keep its estimates current
            return Candidate(0.0, 0, "off", fixed=True)
        mode, k = policy.decide(live.rounds, self._match(live))
        k = draft_budget(min(k, cfg.k_max), live.req.max_tokens - len(live.out))
        seeded = live.req.params.seed is not None and not live.req.params.greedy
        a = policy.estimate(mode, cfg)
        if policy.probing:
            # A probe asks whether the drafter got better: in a batch it is worth what the prior
            # says, and joins the goodput rule like any row, so it rides along when its drafter
            # runs anyway and waits when it would add a draft pass to a full batch.
            a = cfg.prior_acceptance
        nodes = policy.tree_size(mode, cfg) if DRAFTERS[mode].trees else 0
        return Candidate(a, k, mode, fixed=seeded or not policy.adaptive, nodes=nodes)

    def _match(self, live: _Live) -> Callable[[str], int | None] | None:
        """How long a suffix of ``live``'s context prompt lookup matches this round (0: it
        would propose nothing; None for the other drafters): the policy's estimate of it is
        the one for that length."""
        lookup = self.loop_drafters.get("ngram")
        if lookup is None:
            return None
        return lambda mode: lookup.match_length(live.key, live.ids) if mode == "ngram" else None

    def _shadow(self, live: _Live, row: Row, emitted: list[int]) -> None:
        """Score the free drafters ``live``'s policy may choose but this round did not run on
        the tokens it emitted (``SpeculationPolicy.shadow``), in its record and the unit's: a
        request learns at once whether its text repeats, whatever the unit's other requests
        taught the record, and one in plain fallback resumes as soon as it does."""
        policy = live.policy
        for mode in (policy.shadowed & set(policy.modes)) - {row.mode}:
            match, proposed = self.loop_drafters[mode].match(live.key, row.context, policy.config().k_max)
            stats = policy.shadow(mode, proposed, emitted, match)
            if stats is not None:
                with self._record_lock:
                    self.record.observe(stats, UNIT_EWMA, self.policy_config().prior_acceptance, False, ran=False)

    def _stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        return req.stop_token_ids if req.ignore_eos else req.stop_token_ids | self.eos_token_ids

    def _suppressed(self, live: _Live) -> dict:
        """min_tokens: the stop tokens the target may not emit, and for how many of this round's
        positions. It is part of the target's distribution p, so verification stays exact."""
        left = live.req.min_tokens - len(live.out)
        return dict(suppress=tuple(sorted(self._stop_ids(live.req))), suppress_for=left) if left > 0 else {}

    # --- draft and verify ---------------------------------------------------------------------

    def _draft_in_loop(self, plan: StepPlan) -> tuple[StepPlan, Drafting]:
        """The drafters that run in the loop write their proposals into the plan."""
        here = draft_all(self.loop_drafters, plan)
        if not here.proposals:
            return plan, here
        return StepPlan([dataclasses.replace(r, proposal=here.proposals[r.key]) if r.key in here.proposals else r
                         for r in plan.rows]), here

    def _verify(self, plan: StepPlan) -> tuple[StepPlan, StepResult, dict[str, str]]:
        """The draft side's call (it returns at once), then the target's. A failed draft side
        makes its rows plain for this step and for the next ``DRAFT_RETRY_ROUNDS`` rounds,
        except seeded sampled rows: which tokens rejection sampling draws depends on how the
        rounds are cut, so a plain round would change their text. They sit the step out and
        try again next step (up to ``HOLD_SEEDED_S``, then they too run plainly)."""
        external_rows = [r for r in plan.rows if r.speculates and DRAFTERS[r.mode].where == "draft"]
        external, release = None, self._take_release("target")  # kept for the plain retry: never lost
        try:  # a remote draft side may refuse at once (its worker is restarting)
            if external_rows and self.draft is not None:
                external = self.draft.propose(draft_rows(external_rows), self._take_release("draft"))
            result = self.target.run(plan, external, release)
        except DraftUnavailable as exc:  # the draft side logged what happened to it
            log.debug("draft side unavailable (%s); this step's drafts run plainly", exc)
            why = f"{type(exc).__name__}: {exc}"
        else:
            for live in self._running:
                live.held_since = 0.0
            return plan, result, {}
        failed, held, now = {r.key for r in external_rows}, set(), time.monotonic()
        for live in self._running:
            if live.key not in failed:
                continue
            if live.req.params.seed is not None and live.req.params.temperature > 0:
                live.held_since = live.held_since or now
                if now - live.held_since < HOLD_SEEDED_S:
                    held.add(live.key)
                    continue
            live.draft_retry_at = len(live.rounds) + DRAFT_RETRY_ROUNDS
        rows = [dataclasses.replace(r, mode="off", k=0, proposal=EMPTY_PROPOSAL) if r.key in failed else r
                for r in plan.rows if r.key not in held]
        if not rows:  # every row waits for the draft side
            self._release = [("target", key) for key in release] + self._release
            time.sleep(HOLD_POLL_S)
            return StepPlan([]), StepResult([], []), {}
        plan = StepPlan(rows)
        return plan, self.target.run(plan, None, release), dict.fromkeys(failed - held, why)

    def _take_release(self, side: str) -> list[str]:
        keys = [k for s, k in self._release if s == side]
        self._release = [(s, k) for s, k in self._release if s != side]
        return keys

    def _observe_costs(self, plan: StepPlan, result: StepResult, costs: dict[str, tuple[float, int]],
                       decoding: bool) -> None:
        """The step's costs into the unit's model: its pass only without a prompt in it (the
        model prices decode rows' tokens, ``StepCosts.verify_s``), its drafting always.

        Not the first pass of a shape: it pays for building that shape's kernels. On the demo
        target (bf16, 2-core AMD EPYC with AVX-512 BF16) a fresh process verified 2-4 tokens in
        44-51 ms the first time and 28-31 ms after; kept, those points bent the lone request's
        hinge into a line (v(2) = 1.61: trees kept one node), and a drafter's one cold round
        priced it out for good (c of the draft model 0.75 against ~0.15), as it was never
        chosen again to be timed warm."""
        if result.tokens and decoding and self._warm(("verify", len(plan.rows), result.tokens)):
            self.costs.observe_verify(result.tokens, result.verify_s)
        for mode, (seconds, steps) in costs.items():
            rows = len(plan.drafting(mode))
            if rows and steps and seconds > 0 and self._warm((mode, rows)):
                self.costs.observe_draft(mode, rows, seconds / steps)

    def forget_acceptance(self) -> None:
        """Start the unit's drafter record afresh (``Engine.warm_up``: its rounds' acceptance
        on its one prompt is nobody's traffic); the costs and the shapes timed stay."""
        with self._record_lock:
            self.record = DrafterRecord()
        self.timings.clear()

    def _warm(self, shape: tuple) -> bool:
        """Whether a pass of ``shape`` ran before (and remember that one has now)."""
        if shape in self._shapes:
            return True
        self._shapes.add(shape)
        return False

    # --- commit -------------------------------------------------------------------------------

    def _commit(self, live: _Live, row: Row, verdict, confidence: tuple[float, ...], draft_s: float,
                verify_s: float, started_at: float, draft_error: str | None, full: bool | None = None) -> int:
        tokens, finish = cut_round(verdict.tokens, live.req.max_tokens - len(live.out), self._stop_ids(live.req))
        live.out.extend(tokens)
        index = len(live.rounds)
        events: tuple[str, ...] = ()
        if live.policy is not None:  # the decisions taken for this round
            events = tuple(what for _, what in live.policy.events[live.events_sent:])
            live.events_sent = len(live.policy.events)
        lookup = index and row.mode in SHADOWED  # the suffix it matched: at the round's context, as it drafted
        stats = RoundStats(
            index=index, mode="prefill" if index == 0 else row.mode, k=row.k, drafted=verdict.num_drafted,
            accepted=verdict.num_accepted, emitted=len(tokens), draft_s=draft_s, verify_s=verify_s,
            started_at=started_at, draft_error=draft_error, events=events, confidence=confidence, full=full,
            match=self.loop_drafters[row.mode].match_length(live.key, row.context) if lookup else 0,
        )
        live.rounds.append(stats)
        # A tree of a request with an explicit k fills its budget: it says nothing of the size,
        # nor of the per-level acceptance, of the trees the unit's adaptive requests price.
        if stats.drafted and (live.policy is None or live.policy.adaptive or not DRAFTERS[row.mode].trees):
            with self._record_lock:
                self.record.observe(stats, UNIT_EWMA, self.policy_config().prior_acceptance, DRAFTERS[row.mode].trees)
        if index and live.policy is not None:
            self._shadow(live, row, verdict.tokens)
        live.prefilled = len(live.prefill)  # an emitting row has its whole prefill behind it
        delta, kept = live.text.add(tokens)
        if live.text.stopped:
            finish = "stop"
        if finish:
            delta += live.text.finish()
        summary = (live.policy.summary() if live.policy else {}) if finish else None
        first = index == 0
        logprobs = None if verdict.logprobs is None else verdict.logprobs[: len(kept)]
        live.handle.put(RoundEvent(delta, kept, stats, finish, summary, live.queued_s if first else None,
                                   live.cached_tokens if first else None, logprobs))
        if finish:
            self._finish(live)
        return len(tokens)

    def _finish(self, live: _Live, *, cancelled: bool = False, error: str | None = None) -> None:
        if live in self._running:
            self._running.remove(live)
            self.blocks.release(live.blocks)
            live.blocks = []
            self._release += [("target", live.key), ("draft", live.key)]
            for drafter in self.loop_drafters.values():
                drafter.release(live.key)
        if error is not None:
            live.handle.put(ErrorEvent(error))
        elif not cancelled:
            self._check_quality(live)

    # --- the quality guard ------------------------------------------------------------------

    def _replay(self, req: GenerationRequest, expected: list[int]) -> _Live:
        """A request again, speculation off, that must emit ``expected``."""
        plain = dataclasses.replace(req, mode="off", k=None, logprobs=None)
        text = TextStream(self.tokenizer, stop=list(req.stop), min_tokens=req.min_tokens)
        return _Live(plain, Handle(uuid.uuid4().hex), 0, None, text, expected=list(expected), replayed=req)

    def _check_quality(self, live: _Live) -> None:
        """A finished request: replay it (some greedy ones that speculated), or judge a replay."""
        cfg = live.req.flags or self.policy_config()  # the flags it was admitted under, where it has its own
        if live.expected is None:
            speculated = any(r.drafted for r in live.rounds)
            if speculated and cfg.replay_fraction > 0 and self.quality.wants(cfg.replay_fraction):
                if live.req.params.greedy:
                    self._replays.append(self._replay(live.req, live.out))
                else:
                    self._scores.append((live.req, list(live.out)))
            return
        match = live.out == live.expected
        if not match:
            at = next((i for i, (a, b) in enumerate(zip(live.out, live.expected)) if a != b),
                      min(len(live.out), len(live.expected)))
            log.warning("quality guard: request %s gave other tokens than plain decoding from token %d on",
                        live.req.tag or "(untagged)", at)
        self._judge(match, live.replayed)

    def _judge(self, match: bool, req: GenerationRequest) -> None:
        tripped = self.quality.record(match, trip=self.policy_config().replay_trip)
        if self.on_replay is not None:
            self.on_replay(match, req)
        if tripped and self.on_quality_trip is not None:
            self.on_quality_trip(self.quality.counts())

    def _score(self, req: GenerationRequest, out: list[int]) -> None:
        """A sampled answer, checked in distribution (``specdec.engine.replay``): the target scores
        the emitted tokens in one plain forward; their transforms join the guard's windows."""
        score = getattr(self.target, "score", None)
        if score is None or not out:
            return  # the target runs in a worker: sampled answers are not checked (greedy ones are)
        ids = req.prompt_ids + out
        logits = score(ids, len(out))
        stop = list(self._stop_ids(req))
        if req.params.penalized:  # each position's processors read the output before it
            logits = penalize(logits, req.params, req.prompt_ids, len(req.prompt_ids),
                              [out[:j] for j in range(len(out))])
        if req.min_tokens and stop:  # the p the request was sampled from: stop ids suppressed this long
            logits[: req.min_tokens, [t for t in stop if t < logits.shape[-1]]] = -math.inf
        if req.grammar is not None:  # ... and inside its grammar
            g = grammar.tracker().grammars
            allowed = g.tree_allowed(g.matcher(req.grammar, []), out[:-1], None, logits.shape[-1])
            logits = logits.masked_fill(~(allowed | ~allowed.any(-1, keepdim=True)), -math.inf)
        p = logits_to_probs(logits, req.params)
        v = torch.rand(len(out), generator=make_generator(round_seed(len(ids), self.quality.replayed, TARGET)))
        for passed in self.quality.sampled(randomized_pit(p, out, v)):
            if not passed:
                log.warning("quality guard: sampled answers (the last one: request %s) are not distributed "
                            "as the target's own samples would be", req.tag or "(untagged)")
            self._judge(passed, req)
