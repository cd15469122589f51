"""What the step loop tells a request, as typed events: one ``RoundEvent`` per round (the last
one has ``finish_reason``), or one ``ErrorEvent`` when the unit failed the request."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.stats import RoundStats


@dataclass(frozen=True)
class RoundEvent:
    """One round's output as text and ids, and what the round did."""

    text: str
    token_ids: list[int]
    stats: RoundStats
    finish_reason: str | None = None  # "stop" / "length" on the last event
    policy_summary: dict | None = None  # the speculation controller's summary, on the last event
    queued_s: float | None = None  # on the first event: from submit to admission into the batch
    cached_tokens: int | None = None  # on the first event: prompt tokens whose KV came from the prefix cache
    # asked for: per token of ``token_ids``, (its log-probability, ((id, log-probability), ...) most likely first)
    logprobs: tuple | None = None


@dataclass(frozen=True)
class ErrorEvent:
    """The unit failed this request (the batch it shared went on without it)."""

    message: str
