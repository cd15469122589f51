"""An in-process engine: tokenizer, target, drafters and the decoding loop together.

Used by the CLI and by a serving unit that loads its models in process. Text handling
(chat templates, stop strings, streaming deltas) lives here; the loop in ``decoding`` sees
only token ids.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from specdec.config import ModelConfig, SpeculationConfig
from specdec.decoding import DecodeRequest, LocalTarget, RoundStats, Target, decode
from specdec.drafters.base import Drafter
from specdec.drafters.early_exit import load_early_exit
from specdec.drafters.model import ModelDrafter, check_same_vocabulary
from specdec.drafters.ngram import NgramDrafter
from specdec.policy import CostModel, ModeSwitch, PolicyConfig, SpeculationPolicy
from specdec.runner import ModelRunner, load_model, load_tokenizer
from specdec.sampling import SamplingParams
from specdec.stats import SpeculationSummary
from specdec.text import TextStream


@dataclass
class Event:
    """One round's output as text and ids; ``finish_reason`` is set on the last event."""

    text: str
    token_ids: list[int]
    stats: RoundStats
    finish_reason: str | None = None
    policy: dict | None = None  # the controller's summary, on the last event


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    speculation: SpeculationSummary
    rounds: list[RoundStats] = field(default_factory=list)
    policy: dict = field(default_factory=dict)
    ttft_s: float = 0.0
    total_s: float = 0.0

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


class Engine:
    """Text in, tokens and text out, over any ``Target`` and set of drafters.

    ``Engine.load`` puts the models in this process; a serving unit may pass remote ones.
    """

    def __init__(
        self,
        tokenizer,
        target: Target,
        drafters: dict[str, Drafter],
        *,
        eos_token_ids: frozenset[int],
        speculation: SpeculationConfig | None = None,
        policy: PolicyConfig | None = None,
    ):
        self.tokenizer = tokenizer
        self.target = target
        self.drafters = drafters
        self.eos_token_ids = eos_token_ids
        self.speculation = speculation or SpeculationConfig()
        self.policy = policy or PolicyConfig()  # replaced whole, live, by operators
        self.costs = CostModel()  # the unit's measured draft / verify costs
        self._active = 0  # requests decoding now: the load the policy sees
        self._active_lock = threading.Lock()

    @classmethod
    def load(cls, models: ModelConfig, speculation: SpeculationConfig | None = None) -> "Engine":
        speculation = speculation or SpeculationConfig()
        tokenizer = load_tokenizer(models.target)
        target_model = load_model(models.target, models.dtype, models.device)
        drafters: dict[str, Drafter] = {
            "ngram": NgramDrafter(speculation.ngram_min, speculation.ngram_max)
        }
        if models.draft:
            check_same_vocabulary(tokenizer, load_tokenizer(models.draft))
            draft_model = load_model(models.draft, models.draft_dtype, models.device)
            drafters["draft"] = ModelDrafter(ModelRunner(draft_model))
        target_runner = ModelRunner(target_model)
        if models.early_exit_adapter or models.early_exit_layer is not None:
            # Shares the target's runner: the draft runs the target's first layers on its cache.
            drafters["early_exit"] = load_early_exit(
                target_runner, models.early_exit_layer, models.early_exit_adapter,
                threshold=speculation.early_exit_threshold,
            )
        return cls(
            tokenizer,
            LocalTarget(target_runner),
            drafters,
            eos_token_ids=eos_token_ids(tokenizer, target_model),
            speculation=speculation,
        )

    @property
    def max_length(self) -> int | None:
        return self.target.max_length

    def resolve_mode(self, mode: str | None) -> str:
        """The mode a request runs in: its own, else the default; the kill switch wins."""
        mode = mode or self.policy.default_mode or self.speculation.mode
        if mode not in ("auto", "off") and mode not in self.drafters:
            raise ValueError(f"speculation mode {mode!r} is not available (no draft model configured)")
        return "off" if self.policy.kill_switch else mode

    def _policy(
        self, mode: str, k: int | None, params: SamplingParams
    ) -> tuple[ModeSwitch | None, SpeculationPolicy | None]:
        """The drafter and per-round controller for a request in ``mode`` asking for ``k``.

        Which tokens rejection sampling draws depends on how the rounds were cut, so a seeded
        sampling request decides on prior costs alone (``CostModel(frozen=True)``): its
        schedule then follows only its own, seeded, acceptance, and the seed reproduces it.
        """
        if mode == "off":
            return None, None
        seeded = params.seed is not None and not params.greedy
        switch = ModeSwitch(self.drafters if mode == "auto" else {mode: self.drafters[mode]})
        adaptive = self.policy.adaptive and (k is None or mode == "auto")
        policy = SpeculationPolicy(
            switch=switch,
            costs=CostModel(frozen=True) if seeded else self.costs,
            config=lambda: self.policy,
            k_request=k or self.speculation.num_speculative_tokens,
            adaptive=adaptive,
            load=lambda: self._active,
        )
        return switch, policy

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Prompt ids from plain text or from chat messages (the tokenizer's chat template)."""
        if messages is not None:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
        if prompt is None:
            raise ValueError("either prompt or messages is required")
        return self.tokenizer(prompt)["input_ids"]

    def stream(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        params: SamplingParams = SamplingParams(),
        stop: list[str] | None = None,
        mode: str | None = None,
        k: int | None = None,
        request_id: str | None = None,
    ) -> Iterator[Event]:
        mode = self.resolve_mode(mode)
        drafter, policy = self._policy(mode, k, params)
        request = DecodeRequest(
            prompt_ids=list(prompt_ids),
            max_tokens=max_tokens,
            params=params,
            eos_token_ids=self.eos_token_ids,
            seq_id=request_id or uuid.uuid4().hex,
        )
        text = TextStream(self.tokenizer, stop=list(stop or []))
        steps = decode(self.target, drafter, request, k=policy or 0)
        with self._active_lock:
            self._active += 1
        try:
            for step in steps:
                delta, kept = text.add(step.tokens)
                finish = "stop" if text.stopped else step.finish_reason
                if finish:
                    delta += text.finish()
                summary = (policy.summary() if policy else {}) if finish else None
                yield Event(delta, kept, step.stats, finish_reason=finish, policy=summary)
                if finish:
                    return
        finally:
            steps.close()  # releases the caches, also when the consumer stops early
            with self._active_lock:
                self._active -= 1

    def generate(self, prompt_ids: list[int], **kwargs) -> Completion:
        mode = self.resolve_mode(kwargs.get("mode"))
        start = time.perf_counter()
        ttft = 0.0
        texts, ids, rounds = [], [], []
        finish, policy = "length", {}
        for event in self.stream(prompt_ids, **kwargs):
            if not rounds:
                ttft = time.perf_counter() - start
            texts.append(event.text)
            ids.extend(event.token_ids)
            rounds.append(event.stats)
            finish = event.finish_reason or finish
            policy = event.policy or policy
        return Completion(
            text="".join(texts),
            token_ids=ids,
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            speculation=SpeculationSummary.from_rounds(mode, rounds),
            rounds=rounds,
            policy=policy,
            ttft_s=ttft,
            total_s=time.perf_counter() - start,
        )
