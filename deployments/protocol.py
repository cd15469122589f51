"""The OpenAI-style request schemas and error objects of the HTTP API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from specdec.config import Mode


class SpeculationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)


# OpenAI options that change the answer and that this server does not implement: refused (400)
# unless neutral. Penalties are among them: applied to p alone they would break exactness, and
# applying them to both p and q at every position is not done yet.
UNSUPPORTED = (
    "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_p", "response_format", "tools",
    "tool_choice", "functions", "function_call", "parallel_tool_calls", "guided_json", "guided_regex",
)


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. include_obfuscation: it does not change the answer
    include_usage: StrictBool | None = None


class _Common(BaseModel):
    # Fields of the OpenAI API we do not act on (user, ...) are accepted and
    # ignored, as the official client may send them; the ones that would change the answer and
    # that we do not support are refused below.
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX, description="EOS and stop_token_ids cannot end the answer "
                            "before this many tokens, nor can a stop string (vLLM's).")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)  # -1 or 0: no top-k filter (vLLM uses -1)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)  # the operator may narrow it (limits)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="One choice per request.")
    speculation: SpeculationOptions | None = None
    return_token_ids: StrictBool = False
    ignore_eos: StrictBool = Field(False, description="Generate max_tokens tokens whatever EOS says (vLLM's).")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=64, description="Token ids that end the answer, kept in it (vLLM's)."
    )

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):  # how many and how long: the operator's limits, checked at the ingress
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> tuple[str, str] | None:
        """(param, message) for an OpenAI option that would change the answer and we lack, or
        that does not fit the rest of the request (OpenAI's rule: stream_options needs stream).

        A neutral value (null, false, 0, {}, [], "", best_of 1) is the same as leaving the
        option out: clients such as LangChain's send ``logit_bias: {}`` by default.
        """
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            value = extra.get(name)
            if value is None or value is False or value in ({}, [], "") or (value == 0 and not isinstance(value, str)):
                continue
            if name == "best_of" and value == 1:
                continue
            return name, f"'{name}' is not supported by this server"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("the prompt must not be empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart]  # text parts only: images and audio are refused

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


@dataclass(frozen=True)
class UnitRequest:
    """What the ingress hands the unit across the Ray hop: validated and defaulted once, at the
    HTTP edge (the models above hold OpenAI's defaults); the unit reads it as it is."""

    request_id: str
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int | None  # None: 16 for a completion, the rest of the context for chat (OpenAI)
    temperature: float
    top_p: float
    top_k: int  # 0 (or -1): no top-k filter
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    stop_token_ids: list[int]
    min_tokens: int
    mode: str | None  # speculation.mode; None: the unit's default
    k: int | None  # speculation.num_speculative_tokens
    trace_context: dict = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.messages is not None


# --- the unit's answer, event by event (router -> ingress) ------------------------------


@dataclass(frozen=True)
class Start:
    """The request was accepted: its mode, its trace (``traceparent`` of the request span) and
    the ``system_fingerprint`` of the configuration that serves it."""

    prompt_tokens: int
    mode: str
    traceparent: str | None = None
    fingerprint: str | None = None


@dataclass(frozen=True)
class Delta:
    """One round's new text and token ids."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class End:
    """The request finished: why, what it used, and what speculation did (``speculation``:
    ``SpeculationSummary`` fields plus the controller's summary)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculation: dict
    trace_id: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the unit's prefix cache


@dataclass(frozen=True)
class Error:
    """The unit refused (``status`` 4xx, before ``Start``) or failed (500) the request."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


UnitEvent = Start | Delta | End | Error


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
