"""SpecRouter: one replica is one unit of (router, target, draft) on one node.

The router owns every request's token ids and runs the unit's step loop
(``specdec.engine``). With ``colocation: actors`` it starts a TargetWorker and a DraftWorker as
child actors in its own STRICT_PACK placement group (bundles 1 and 2), so both land on its
node; with ``colocation: in_process`` it loads both models itself. One step loop thread serves
every request; each request is an asyncio task awaiting its handle's events, and streams typed
events (``deployments.protocol``: Start, Delta..., End, or Error) back to the ingress.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

import ray
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.autoscaling import StatsRecorder, UnitTotals
from deployments.config import UnitArgs, unit_fingerprint
from deployments.metrics import UnitMetrics
from deployments.protocol import Delta, End, Error, Start, UnitRequest, merge_deltas
from deployments.workers import DraftWorker, RemoteDraft, RemoteTarget, TargetWorker
from specdec import compute, grammar, telemetry
from specdec.loading import check_same_vocabulary
from specdec.engine import Engine, PromptTooLong, draft_tokenizer, target_tokenizer
from specdec.engine.loop import GenerationRequest
from specdec.engine.plan import choice_seed
from specdec.policy import PolicyConfig
from specdec.sampling import SamplingParams
from specdec.stats import SpeculationSummary

log = logging.getLogger("ray.serve")

TARGET_BUNDLE, DRAFT_BUNDLE = 1, 2  # bundle 0 holds the router replica itself
# How long the health check waits for a worker (a restarting one reloads its model); it must stay
# below the deployment's health_check_timeout_s (the builder's default: deployments/config.py).
WORKER_HEALTH_WAIT_S = 45


def worker_name(role: str) -> str:
    """The unit's ``role`` worker ("target", "draft"), named per replica (namespace "serve")."""
    return f"specdec-{role}-{serve.get_replica_context().replica_id.unique_id}"


def _worker_options(role: str, bundle: int, num_cpus: float, num_gpus: float) -> dict:
    pg = get_current_placement_group()
    # Named, so an operator (or a test) can find a unit's workers; restarted by Ray when they
    # die, and re-prefilled from the router's tokens on the next call.
    options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": -1, "name": worker_name(role)}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        )
    return options


def build_engine(args: UnitArgs) -> tuple[Engine, dict]:
    """The unit's engine, and the worker actors it uses (empty in process)."""
    models, spec = args.models, args.speculation
    if args.torch_threads:
        compute.set_threads(args.torch_threads)
    sizes = dict(max_num_seqs=args.max_num_seqs, step_tokens=args.step_tokens, prefix_caching=args.prefix_caching)
    if args.colocation == "in_process":
        return Engine.load(models, spec, kv_cache_tokens=args.kv_cache_tokens, **sizes), {}
    tokenizer = target_tokenizer(models)
    res = args.resources
    target_actor = TargetWorker.options(
        **_worker_options("target", TARGET_BUNDLE, res.target_cpus, res.target_gpus)
    ).remote(models, spec, args.trace_sample_ratio, args.torch_threads, args.kv_cache_tokens,
             worker_name("target"))
    # The draft worker starts at once, beside the target (a worker's process start and imports
    # are most of a unit's start); it sizes its pool from the target's info when that is in.
    # RemoteDraft holds the reference: a restarted draft worker reads it again.
    info_ref = target_actor.info.remote()
    actors = {"target": target_actor}
    draft_actor = None
    if models.draft:
        check_same_vocabulary(tokenizer, draft_tokenizer(models))
        draft_actor = DraftWorker.options(
            **_worker_options("draft", DRAFT_BUNDLE, res.draft_cpus, res.draft_gpus)
        ).remote(models, spec, [info_ref], args.trace_sample_ratio, args.torch_threads)
    info = ray.get(info_ref)
    draft = None
    if draft_actor is not None:
        ray.get(draft_actor.ready.remote())
        draft = RemoteDraft(draft_actor, args.draft_timeout_s, sizing=info_ref)
        actors["draft"] = draft_actor
    engine = Engine.from_parts(
        tokenizer, RemoteTarget(target_actor, info["max_length"], args.worker_timeout_s), draft,
        models, eos_token_ids=info["eos_token_ids"], capacity_tokens=info["capacity_tokens"],
        max_length=info["max_length"], speculation=spec, prefix_grid=info["prefix_grid"], **sizes,
    )
    return engine, actors


class RequestError(ValueError):
    """A request the unit refuses; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@serve.deployment(name="SpecRouter")
class SpecRouter:
    def __init__(self, args: dict):
        self.args = UnitArgs.model_validate(args)
        telemetry.configure_tracing("specdec-router", sample_ratio=self.args.trace_sample_ratio,
                                    trust_incoming=self.args.trace_trust_incoming)
        self.model_name = self.args.models.name
        self.engine, self.actors = build_engine(self.args)
        self.engine.max_token_bytes  # computed now (a vocabulary pass), not on the first request
        if self.args.warm_up:
            log.info("warm-up: %.1f s", self.engine.warm_up())
        self.metrics = UnitMetrics(self.model_name)
        self.engine.loop.on_replay = self._replayed
        self.totals = UnitTotals()  # what the unit produced: its autoscaling capacity
        self._autoscaling_stats = StatsRecorder()
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        return unit_fingerprint(self.args.models, self.args.speculation, self.engine.policy_config)

    def _replayed(self, match: bool, request: GenerationRequest) -> None:
        """A quality replay finished (the loop's thread): count it."""
        self.metrics.replays.inc(tags={"mode": request.mode, "match": str(match).lower()})

    def reconfigure(self, user_config: dict) -> None:
        """Operator flags (kill switch, default mode, k_max, fallback thresholds), live."""
        self.engine.policy_config = PolicyConfig.model_validate(user_config or {})
        self.fingerprint = self._fingerprint()
        log.info("policy config now %s (fingerprint %s)", self.engine.policy_config, self.fingerprint)

    def info(self) -> dict:
        """What this unit is and where its parts run (node ids), for operators and tests."""
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "max_length": self.engine.max_length,
            "modes": ["off", "auto", *self.engine.drafters],
            "usage": self.engine.loop.usage(),
            "active_requests": self.metrics.active_requests(),  # the gauge's values, by mode
            "colocation": self.args.colocation,
            "workers": {name: ray.get(actor.node_id.remote()) for name, actor in self.actors.items()},
            "worker_names": {name: worker_name(name) for name in self.actors},
            "policy": self.engine.policy_config.model_dump(),
            "fingerprint": self.fingerprint,
        }

    def _prepare(self, req: UnitRequest) -> GenerationRequest:
        """The request tokenized, defaulted and validated once; a refusal is the client's 400."""
        engine = self.engine
        try:
            mode = engine.resolve_mode(req.mode)
        except ValueError as exc:
            raise RequestError(str(exc), "speculation.mode") from exc
        limits, limit = self.args.limits, engine.max_length
        max_prompt = limits.max_prompt_tokens or (limit - 1 if limit else None)
        field_ = "messages" if req.chat else "prompt"
        try:
            ids = self._prompt_ids(req.prompt, max_prompt) if isinstance(req.prompt, list) else (
                engine.encode(prompt=req.prompt, messages=req.messages, max_tokens=max_prompt))
        except PromptTooLong as exc:
            raise RequestError(str(exc), field_, "context_length_exceeded") from exc
        except RequestError:
            raise
        except Exception as exc:  # a chat template may reject a conversation
            raise RequestError(f"could not encode the prompt: {exc}", field_) from exc
        max_tokens = req.max_tokens
        if max_tokens is None:  # OpenAI: 16 for a completion, the rest of the context for chat ...
            max_tokens = max(1, (limit or len(ids) + 16) - len(ids)) if req.chat else 16
            if req.chat and limits.default_max_tokens:  # ... which the operator caps
                max_tokens = min(max_tokens, limits.default_max_tokens)
        if limit is not None and len(ids) + max_tokens > limit:
            raise RequestError(
                f"this model's context length is {limit} tokens; the prompt has {len(ids)} and "
                f"max_tokens is {max_tokens}",
                "max_tokens", "context_length_exceeded",
            )
        if req.min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                               "min_tokens")
        vocab = len(engine.tokenizer)
        if any(t >= vocab for t, _ in req.logit_bias):
            raise RequestError(f"logit_bias: token ids must be below the vocabulary size ({vocab})", "logit_bias")
        try:
            params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                                    min_p=req.min_p, presence_penalty=req.presence_penalty,
                                    frequency_penalty=req.frequency_penalty,
                                    repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias)
        except ValueError as exc:
            raise RequestError(str(exc), "temperature") from exc
        if req.grammar is not None:
            try:
                grammar.tracker().grammars.compile(req.grammar)
            except ValueError as exc:
                raise RequestError(str(exc), req.grammar_param, "invalid_value") from exc
        logprobs = req.logprobs
        if req.best_of > req.n and logprobs is None:
            logprobs = 0  # best_of ranks the choices by their log-probability
        try:
            greq = engine.request(ids, max_tokens=max_tokens, params=params, stop=req.stop, mode=mode,
                                  k=req.k,  # the policy caps it at the operator's k_max
                                  ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids,
                                  min_tokens=req.min_tokens, logprobs=logprobs, grammar=req.grammar)
        except ValueError as exc:
            raise RequestError(str(exc), "max_tokens") from exc
        # A streamed answer in chunks of stream_interval tokens; one that is not streamed, whole.
        return dataclasses.replace(greq, stream_interval=self.args.stream_interval if req.stream else max_tokens)

    def _prompt_ids(self, ids: list[int], max_prompt: int | None) -> list[int]:
        """A prompt given as token ids, checked against the vocabulary and the token limit."""
        vocab = len(self.engine.tokenizer)
        if any(t >= vocab for t in ids):
            raise RequestError(f"prompt: token ids must be below the vocabulary size ({vocab})", "prompt")
        if max_prompt is not None and len(ids) > max_prompt:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens; this server's limit is {max_prompt}")
        return list(ids)

    async def generate(self, req: UnitRequest):
        """The request's typed events: ``Start``, then each choice's ``Delta`` per round and its
        ``End``; or one ``Error`` (400 before ``Start`` for a refused request, 500 if the unit
        failed it)."""
        try:  # tokenizing a long prompt is CPU work: off the event loop
            greq = await asyncio.to_thread(self._prepare, req)
        except RequestError as exc:
            yield Error(400, str(exc), exc.param, exc.code)
            return
        try:
            echoed = await self._echo(req, greq)
            async for event in self._choices(req, greq, echoed):
                yield event
        except Exception as exc:  # never let a request take the replica down
            log.exception("request failed")
            yield Error(500, f"internal error: {type(exc).__name__}")

    async def _echo(self, req: UnitRequest, greq: GenerationRequest) -> Delta | None:
        """``echo``: the prompt as the first Delta of each choice, with its tokens'
        log-probabilities from one plain forward when asked (the first token has none)."""
        if not req.echo:
            return None
        ids, logprobs = greq.prompt_ids, None
        if req.logprobs is not None:
            scored = await asyncio.to_thread(self.engine.prompt_logprobs, ids, req.logprobs)
            logprobs = [(self._piece(ids[0]), None, None), *self._named(ids[1:], scored)]
        text = req.prompt if isinstance(req.prompt, str) else self.engine.tokenizer.decode(ids)
        return Delta(text, [], 0, logprobs)  # token_ids stay the completion's

    def _piece(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def _named(self, tokens: list[int], logprobs) -> list:
        """Delta.logprobs for ``tokens`` and their engine log-probabilities: ids become text."""
        return [(self._piece(t), lp, [(self._piece(i), v) for i, v in top]) for t, (lp, top) in zip(tokens, logprobs)]

    async def _choices(self, req: UnitRequest, greq: GenerationRequest, echoed: Delta | None):
        """Every choice's events, merged: ``best_of`` choices run side by side in the step loop
        (the loop shares their prompt's blocks), each seeded from the request's seed; with
        ``best_of > n`` the n with the highest log-probability are returned, renumbered."""
        count = max(req.n, req.best_of)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._choice(req, self._seeded(greq, i), i, queue)) for i in range(count)]
        keep = req.best_of > req.n
        held: dict[int, list] = {i: [] for i in range(count)}
        try:
            ended, ready = 0, collections.deque()
            while ended < count:
                if not ready:  # everything the choices have sent, consecutive Deltas joined
                    ready.append(await queue.get())
                    while not queue.empty():
                        ready.append(queue.get_nowait())
                    ready = collections.deque(merge_deltas(list(ready)))
                event = ready.popleft()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Start):
                    yield event
                    if echoed is not None and not keep:
                        for i in range(count):
                            yield dataclasses.replace(echoed, index=i)
                    continue
                ended += isinstance(event, End)
                if keep:
                    held[event.index].append(event)
                    continue
                if isinstance(event, Delta) and req.logprobs is None:
                    event = dataclasses.replace(event, logprobs=None)
                yield event
        finally:
            for task in tasks:
                task.cancel()
        if keep:
            def score(i: int) -> float:
                return sum(lp for e in held[i] if isinstance(e, Delta) for _, lp, _ in e.logprobs or () if lp is not None)
            ranked = sorted(range(count), key=lambda i: (-score(i), i))
            for new, old in enumerate(ranked[: req.n]):
                if echoed is not None:
                    yield dataclasses.replace(echoed, index=new)
                for event in held[old]:
                    if isinstance(event, Delta) and req.logprobs is None:
                        event = dataclasses.replace(event, logprobs=None)
                    yield dataclasses.replace(event, index=new)
            for old in ranked[req.n:]:  # not returned, but generated: usage counts them (index -1)
                yield dataclasses.replace(next(e for e in held[old] if isinstance(e, End)), index=-1)

    @staticmethod
    def _seeded(greq: GenerationRequest, index: int) -> GenerationRequest:
        """Choice ``index``: the request's seed for the first, one derived from it for the others."""
        seed = greq.params.seed
        if index == 0 or seed is None:  # no seed: each choice draws its own
            return greq
        return dataclasses.replace(greq, params=dataclasses.replace(greq.params, seed=choice_seed(seed, index)))

    async def _choice(self, req: UnitRequest, greq: GenerationRequest, index: int, queue: asyncio.Queue) -> None:
        try:
            async for event in self._run(req, greq, index):
                queue.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)

    async def _run(self, req: UnitRequest, greq: GenerationRequest, index: int = 0):
        params, prompt_tokens = greq.params, len(greq.prompt_ids)
        attrs = telemetry.request_attributes(
            operation="chat" if req.chat else "text_completion", model=self.model_name,
            request_id=req.request_id, max_tokens=greq.max_tokens, temperature=params.temperature,
            top_p=params.top_p, top_k=params.top_k, seed=params.seed, mode=greq.mode,
        )
        if req.user:
            attrs["enduser.id"] = req.user  # the tenant: what speculation saved, per user
        if max(req.n, req.best_of) > 1:
            attrs["specdec.choice"] = index
        with telemetry.request_span(carrier=req.trace_context, attributes=attrs,
                                    trust_incoming=self.args.trace_trust_incoming) as trace:
            # The fingerprint the answer carries and the flags it runs under, read together.
            fingerprint, flags = self.fingerprint, self.engine.policy_config
            if index == 0:
                yield Start(prompt_tokens, greq.mode, telemetry.inject(trace.span).get("traceparent"), fingerprint)
            trace_id = trace.span.get_span_context().trace_id.to_bytes(16, "big").hex()
            greq = dataclasses.replace(greq, tag=f"trace {trace_id} (x-request-id {req.request_id})", flags=flags)
            produced, finish, controller, cached = 0, None, {}, None
            start, ttft = time.perf_counter(), 0.0
            self.metrics.set_active(greq.mode, +1)
            try:
                async for event in self.engine.astream(greq):
                    if not trace.stats:
                        ttft = time.perf_counter() - start
                    trace.record(event.stats)
                    self.metrics.event(event, greq.mode)
                    self.totals.observe(event.stats)
                    produced += len(event.token_ids)
                    finish = event.finish_reason
                    controller = event.policy_summary or controller
                    cached = event.cached_tokens if event.cached_tokens is not None else cached
                    logprobs = None if event.logprobs is None else self._named(event.token_ids, event.logprobs)
                    yield Delta(event.text, event.token_ids, index, logprobs)
            except (asyncio.CancelledError, GeneratorExit):  # the client went away: its handle is cancelled
                finish = "cancelled"
                raise
            finally:
                self.metrics.set_active(greq.mode, -1)
                self.metrics.request(greq.mode, prompt_tokens=prompt_tokens, tokens=produced,
                                     finish=finish or "error", ttft_s=ttft, total_s=time.perf_counter() - start,
                                     controller=controller, passes=len(trace.stats))
            summary = SpeculationSummary.from_rounds(greq.mode, trace.stats)
            trace.finish(mode=summary.mode, finish_reason=finish, input_tokens=prompt_tokens, output_tokens=produced,
                         cached_tokens=cached)
            yield End(finish, prompt_tokens, produced, {**summary.to_dict(), **controller},
                      trace.span.get_span_context().trace_id.to_bytes(16, "big").hex(), cached or 0, index)

    def check_health(self) -> None:
        """Every worker answers (in process: the step loop is alive). A busy target answers
        between steps, so a long step delays the answer without failing it."""
        for name, actor in self.actors.items():
            ray.get((actor.info if name == "target" else actor.ready).remote(), timeout=WORKER_HEALTH_WAIT_S)
        self.engine.loop.check_alive()

    def record_autoscaling_stats(self) -> dict:
        """Custom autoscaling metrics (Serve calls this periodically; deployments/autoscaling.py
        reads them): requests decoding now, output tokens/s and draft tokens proposed /
        accepted per second."""
        return self._autoscaling_stats.record(self.engine.active, self.totals)
