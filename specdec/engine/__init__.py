"""The engine: tokenizer, the unit's step loop and its speculation settings together.

Used by the CLI, the benchmark and a serving unit. Text in (a prompt or chat messages), typed
events out (``specdec.engine.events``). Every request goes through the batched step loop
(``specdec.engine.loop``), alone or with others; its target and draft sides are local
(``Engine.load``) or worker actors (the serving unit in ``actors`` mode).

    plan.py      one step as a typed plan, and the round helpers (seeds, cuts)
    schedule.py  the unit's measured costs and the goodput rule (each row's k under load)
    loop.py      admission, planning, drafting in the loop, commit; the request handles
    target.py    the target's side of a step: its drafters, one forward, verification, rollback
    events.py    what a request is told
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import torch

from specdec import compute
from specdec import grammar as grammars
from specdec.batch.runner import BatchRunner
from specdec.config import ModelConfig, SpeculationConfig
from specdec.drafters import build_drafters, offered_modes
from specdec.drafters.base import BatchDrafter, Drafted, DraftRow
from specdec.engine.events import RoundEvent
from specdec.engine.loop import GenerationRequest, StepLoop
from specdec.engine.target import TargetStep
from specdec.grammar import GrammarSpec
from specdec.loading import check_same_vocabulary, load_model, load_tokenizer
from specdec.policy import PolicyConfig
from specdec.sampling import SamplingParams
from specdec.stats import RoundStats, SpeculationSummary

MAX_LOGPROBS = 20  # the most top log-probabilities a token reports (OpenAI's top_logprobs limit)

log = logging.getLogger(__name__)

__all__ = ["Completion", "Engine", "LocalDraft", "PromptTooLong", "RoundEvent", "draft_tokenizer", "eos_token_ids",
           "load_draft_step", "load_target_step", "local_parts", "target_tokenizer"]


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    speculation: SpeculationSummary
    rounds: list[RoundStats] = field(default_factory=list)
    policy_summary: dict = field(default_factory=dict)  # the speculation controller's
    ttft_s: float = 0.0
    total_s: float = 0.0
    logprobs: list | None = None  # asked for: per token, (log-probability, ((id, log-probability), ...))

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.total_s if self.total_s else 0.0


def eos_token_ids(tokenizer, model) -> frozenset[int]:
    """EOS ids from the tokenizer and the model's generation config (which may list several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return frozenset(ids)


class PromptTooLong(ValueError):
    """A prompt over the operator's token limit (refused before or after tokenizing)."""


WARM_UP_TEXT = "Warm-up 0 1 2 3 4 5 6 7 8 9"  # ``Engine.warm_up``'s prompt: a text no request is expected to share
WARM_UP_ROWS = 8  # ``Engine.warm_up``'s batch (at most ``max_num_seqs``)


class Engine:
    """Text in, tokens and text out, over the unit's step loop.

    ``Engine.load`` puts the models in this process; a serving unit may pass a loop over
    worker actors.
    """

    def __init__(self, tokenizer, loop: StepLoop, *, speculation: SpeculationConfig | None = None,
                 policy_config: PolicyConfig | None = None):
        self.tokenizer = tokenizer
        self.loop = loop
        self.speculation = speculation or SpeculationConfig()
        self.policy_config = policy_config or PolicyConfig()  # the operator's flags: replaced whole, live
        loop.policy_config = lambda: self.policy_config
        loop.on_quality_trip = self._quality_tripped

    def _quality_tripped(self, counts: dict) -> None:
        """The quality guard saw speculation change answers: the live kill switch, by itself."""
        self.policy_config = self.policy_config.model_copy(update={"kill_switch": True})
        log.error("quality guard: %d of %d replayed requests gave other tokens than plain decoding; "
                  "speculation is now off for this unit (kill_switch). Investigate, then set "
                  "kill_switch: false to resume.", counts["mismatches"], counts["replayed"])

    @classmethod
    def load(cls, models: ModelConfig, speculation: SpeculationConfig | None = None, *,
             kv_cache_tokens: int | None = None, max_num_seqs: int = 16, step_tokens: int = 512,
             prefix_caching: bool = True) -> "Engine":
        """Both models in this process."""
        speculation = speculation or SpeculationConfig()
        tokenizer = target_tokenizer(models)
        target, draft, eos = compute.run(local_parts, models, speculation, tokenizer, kv_cache_tokens)
        return cls.from_parts(tokenizer, target, draft, models, eos_token_ids=eos,
                              capacity_tokens=target.runner.capacity, max_length=target.max_length,
                              speculation=speculation, max_num_seqs=max_num_seqs, step_tokens=step_tokens,
                              prefix_caching=prefix_caching)

    @classmethod
    def from_parts(cls, tokenizer, target, draft, models: ModelConfig, *, eos_token_ids: frozenset[int],
                   capacity_tokens: int, max_length: int | None, speculation: SpeculationConfig,
                   max_num_seqs: int = 16, step_tokens: int = 512, prefix_caching: bool = True,
                   prefix_grid: int | None = None) -> "Engine":
        """The one builder: a step loop over a target side and a draft side, local (a
        ``TargetStep``, a ``LocalDraft``) or worker actors behind the same two methods; the
        drafters that run in the loop itself are built here. ``prefix_grid``: the target's
        ``BatchRunner.prefix_grid`` (read from a local one when not given)."""
        if prefix_grid is None and hasattr(target, "runner"):
            prefix_grid = target.runner.prefix_grid
        loop = StepLoop(target, draft, offered_modes(models), tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                        capacity_tokens=capacity_tokens, max_num_seqs=max_num_seqs, step_tokens=step_tokens,
                        loop_drafters=build_drafters("loop", models, speculation, None, capacity_tokens),
                        default_k=speculation.num_speculative_tokens, max_length=max_length,
                        tree_width=speculation.tree_width, fixed_chunks=models.numerics == "batch_invariant",
                        prefix_caching=prefix_caching, prefix_grid=prefix_grid)
        grammars.configure(tokenizer, sorted(eos_token_ids))  # structured output, validated here
        return cls(tokenizer, loop, speculation=speculation)

    @property
    def drafters(self) -> list[str]:
        """The speculation modes this engine can draft with."""
        return self.loop.modes

    @property
    def max_length(self) -> int | None:
        return self.loop.max_length

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.loop.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.loop.eos_token_ids = frozenset(ids)

    @property
    def target_model(self) -> torch.nn.Module | None:
        """The target model when it is in this process (None over worker actors)."""
        runner = getattr(self.loop.target, "runner", None)
        return runner.model if runner is not None else None

    @property
    def draft_model(self) -> torch.nn.Module | None:
        """The draft model when it is in this process."""
        drafter = getattr(self.loop.draft, "drafter", None)
        return drafter.runner.model if drafter is not None else None

    @property
    def costs(self):
        """The unit's measured step costs (``specdec.engine.schedule.StepCosts``)."""
        return self.loop.costs

    @property
    def active(self) -> int:
        """Requests in the unit now (running or waiting): its load."""
        return self.loop.active

    def resolve_mode(self, mode: str | None) -> str:
        """The mode a request runs in: its own, else the default; the kill switch wins."""
        mode = mode or self.policy_config.default_mode or self.speculation.mode
        if mode not in ("auto", "off") and mode not in self.drafters:
            raise ValueError(f"speculation mode {mode!r} is not available: this model offers "
                             f"{', '.join(['auto', 'off', *self.drafters])}")
        return "off" if self.policy_config.kill_switch else mode

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, *,
               max_tokens: int | None = None) -> list[int]:
        """Prompt ids from plain text or from chat messages (the tokenizer's chat template).

        ``max_tokens``: raise ``PromptTooLong`` past it, without tokenizing a text whose UTF-8
        size alone proves it too long (no token spans more than ``max_token_bytes`` bytes).
        """
        if prompt is None and messages is None:
            raise ValueError("either prompt or messages is required")
        if max_tokens is not None:
            texts = [prompt] if messages is None else [str(m.get("content", "")) for m in messages]
            size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
            if size > max_tokens * self.max_token_bytes:
                raise PromptTooLong(f"the prompt ({size} bytes) is longer than this server's limit of "
                                    f"{max_tokens} tokens")
        if messages is not None:
            ids = list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens; this server's limit is {max_tokens}")
        return ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: a text of ``n`` bytes
        has at least ``n / max_token_bytes`` tokens. Times 4 when the tokenizer normalizes text
        first (NFKC may shrink a 3-byte character to 1 byte)."""
        tok = self.tokenizer
        longest = max(len(tok.decode([i]).encode("utf-8", "surrogatepass")) for i in range(len(tok)))
        backend = getattr(tok, "backend_tokenizer", None)
        normalizes = backend is None or backend.normalizer is not None
        return max(1, longest) * (4 if normalizes else 1)

    def request(self, prompt_ids: list[int], *, max_tokens: int, params: SamplingParams = SamplingParams(),
                stop: list[str] | None = None, mode: str | None = None, k: int | None = None,
                ignore_eos: bool = False, stop_token_ids: list[int] | None = None,
                min_tokens: int = 0, logprobs: int | None = None,
                grammar: GrammarSpec | None = None) -> GenerationRequest:
        """The one place a request is validated and defaulted."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens ({max_tokens})], got {min_tokens}")
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must lie in [0, {MAX_LOGPROBS}], got {logprobs}")
        if grammar is not None:
            grammars.tracker().grammars.compile(grammar)  # ValueError: the client's 400
        limit = self.max_length
        if limit is not None and len(prompt_ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the model's context length ({limit})"
            )
        req = GenerationRequest(list(prompt_ids), max_tokens, params, self.resolve_mode(mode), k,
                                tuple(stop or ()), ignore_eos, frozenset(stop_token_ids or ()), min_tokens,
                                logprobs, grammar)
        self.loop.check_fits(req)
        return req

    def warm_up(self, max_tokens: int = 12) -> float:
        """Run a short request through plain decoding and every drafter (at k = 1 and the
        default k; trees at their budget), then a batch of them plainly and one drafting k each
        (``WARM_UP_ROWS``), then forget what its rounds taught the unit about
        acceptance; returns the seconds it took. A fresh process builds a pass shape's kernels
        the first time it meets it: on the demo target (bf16, 2-core AMD EPYC with AVX-512 BF16)
        2-4 tokens took 44-51 ms the first time against 28-31 ms after, so the first requests
        paid for them, and a drafter timed only cold (the loop skips a shape's first pass, but
        the draft model's catch-ups come in new shapes for a while) was priced out: c of the
        draft model 0.45 in a fresh process against 0.23 after a warm-up. The costs it
        measured stay (warm passes of the unit's own models); its one prompt is nobody's text,
        so its acceptance does not, and it is never replayed."""
        start = time.perf_counter()
        ids = self.encode(prompt=WARM_UP_TEXT)
        flags = self.policy_config.model_copy(update={"kill_switch": False, "replay_fraction": 0.0})
        k = self.speculation.num_speculative_tokens
        # Alone, then a batch: plain rows, and rows of k drafts (a drafting model's: it always
        # drafts), so that the batch's shapes are built and the unit's verify line has timed
        # points at a batch's tokens, not only a lone request's extrapolated (on the demo target,
        # 8 rows of 5 tokens: 68.8 ms timed, 85.4 ms on the line through a lone request's points).
        model = next((m for m in ("eagle", "draft", "medusa", "early_exit") if m in self.drafters), None)
        runs = [(mode, depth, 1) for mode in ["off", *self.drafters]
                for depth in ([None] if mode == "off" else sorted({1, k}))]
        rows = min(WARM_UP_ROWS, self.loop.max_num_seqs)
        runs += [("off", None, rows)] + ([(model, k, rows)] if model is not None else [])
        for mode, depth, count in runs:
            try:
                req = self.request(ids, max_tokens=max_tokens, mode=mode, k=depth, ignore_eos=True)
                with self.loop.together():
                    handles = [self.loop.submit(dataclasses.replace(req, flags=flags)) for _ in range(count)]
            except ValueError as e:  # a context or a cache too small for it: the unit starts cold
                log.warning("warm-up skipped: %s", e)
                break
            for handle in handles:
                for _ in handle:
                    pass
        self.loop.forget_acceptance()
        return time.perf_counter() - start

    def prompt_logprobs(self, ids: list[int], top: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
        """Each prompt token's log-probability after the ones before it (the first has none), and
        the ``top`` most likely tokens there: one plain forward of the target (``echo``)."""
        if len(ids) < 2:
            return []
        target = self.loop.target
        local = isinstance(target, TargetStep)
        logits = compute.run(target.score, ids, len(ids) - 1) if local else target.score(ids, len(ids) - 1)
        logp = logits.float().log_softmax(-1)
        chosen = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        values, indices = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        return [(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, indices.tolist(), values.tolist())]

    def stream(self, prompt_ids: list[int], **kwargs) -> Iterator[RoundEvent]:
        """The request's events as its rounds finish; closing the iterator cancels it."""
        handle = self.loop.submit(self.request(prompt_ids, **kwargs))
        try:
            yield from handle
        finally:
            handle.cancel()

    async def astream(self, request: GenerationRequest) -> AsyncIterator[RoundEvent]:
        """``stream`` for an asyncio task: no thread waits for the request's events."""
        handle = self.loop.submit(request, loop=asyncio.get_running_loop())
        try:
            async for event in handle:
                yield event
        finally:
            handle.cancel()

    def generate(self, prompt_ids: list[int], **kwargs) -> Completion:
        mode = self.resolve_mode(kwargs.get("mode"))
        start = time.perf_counter()
        ttft = 0.0
        texts, ids, rounds, logprobs = [], [], [], None
        finish, policy_summary = "length", {}
        for event in self.stream(prompt_ids, **kwargs):
            if event.logprobs is not None:
                logprobs = (logprobs or []) + list(event.logprobs)
            if not rounds:
                ttft = time.perf_counter() - start
            texts.append(event.text)
            ids.extend(event.token_ids)
            rounds.append(event.stats)
            finish = event.finish_reason or finish
            policy_summary = event.policy_summary or policy_summary
        return Completion(
            text="".join(texts),
            token_ids=ids,
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            speculation=SpeculationSummary.from_rounds(mode, rounds),
            rounds=rounds,
            policy_summary=policy_summary,
            ttft_s=ttft,
            total_s=time.perf_counter() - start,
            logprobs=logprobs,
        )


class LocalDraft:
    """The draft side of a step, in this process: the draft model's drafter."""

    def __init__(self, drafter: BatchDrafter):
        self.drafter = drafter

    def propose(self, rows: list[DraftRow], release: list[str] = ()) -> Drafted:
        for key in release:
            self.drafter.release(key)
            grammars.release(key)
        return self.drafter.propose(rows)


def local_parts(models: ModelConfig, speculation: SpeculationConfig, tokenizer,
                kv_cache_tokens: int | None = None) -> tuple[TargetStep, LocalDraft | None, frozenset[int]]:
    """The target's step (with the drafters that live on it), the draft's, and the EOS ids,
    with the models in this process."""
    target, eos = load_target_step(models, speculation, tokenizer, kv_cache_tokens)
    draft = None
    if models.draft:
        check_same_vocabulary(tokenizer, draft_tokenizer(models))
        draft = load_draft_step(models, speculation, target.runner.capacity)
    return target, draft, eos


def target_tokenizer(models: ModelConfig):
    """The tokenizer requests are encoded with: ``models.tokenizer``, else the target's own."""
    if models.tokenizer:
        return load_tokenizer(models.tokenizer, trust_remote_code=models.trust_remote_code)
    return load_tokenizer(models.target, revision=models.revision, trust_remote_code=models.trust_remote_code)


def draft_tokenizer(models: ModelConfig):
    """The draft's own tokenizer (it must match the target's vocabulary)."""
    return load_tokenizer(models.draft, revision=models.draft_revision, trust_remote_code=models.trust_remote_code)


def load_target_step(models: ModelConfig, speculation: SpeculationConfig, tokenizer,
                     kv_cache_tokens: int | None = None) -> tuple[TargetStep, frozenset[int]]:
    """The target model on its token pool, with the configured drafters that run on it."""
    target_model = load_model(models.target, models.dtype, models.device, revision=models.revision,
                              trust_remote_code=models.trust_remote_code)
    runner = BatchRunner(target_model, capacity_tokens=kv_cache_tokens, max_length=models.max_model_len,
                         invariant=models.numerics == "batch_invariant")
    drafters = build_drafters("target", models, speculation, runner, runner.capacity)
    eos = eos_token_ids(tokenizer, target_model)
    grammars.configure(tokenizer, sorted(eos))  # structured output: masks at verification
    return TargetStep(runner, drafters), eos


def load_draft_step(models: ModelConfig, speculation: SpeculationConfig, capacity_tokens: int) -> LocalDraft:
    """The draft side: its drafter on a pool of the target's size (the loop lays out both alike)."""
    (drafter,) = build_drafters("draft", models, speculation, None, capacity_tokens).values()
    return LocalDraft(drafter)
