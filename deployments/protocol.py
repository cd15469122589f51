"""The OpenAI-style request schemas and error objects of the HTTP API."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from specdec.config import Mode
from specdec.grammar_spec import GrammarSpec


class SpeculationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)


# OpenAI options that change the answer and that this server does not implement: refused (400)
# unless neutral.
UNSUPPORTED = ("suffix", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
MAX_CHOICES = 16  # n and best_of: choices one request may ask for
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (the engine's too)
MAX_LOGIT_BIAS = 300  # entries in logit_bias (OpenAI's limit)


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow")  # description, ...
    name: StrictStr = "response"
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of these."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None


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
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices sampled independently for the prompt (its "
                   "prefill shared); with a seed, choice i is seeded from it reproducibly.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="vLLM's: over prompt and output tokens.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's: after temperature.")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (a string, as OpenAI's) -> bias added to its logit.")
    # Structured output: OpenAI's response_format, or vLLM's names (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(None, min_length=1)
    guided_grammar: StrictStr | None = None
    speculation: SpeculationOptions | None = None
    return_token_ids: StrictBool = False
    ignore_eos: StrictBool = Field(False, description="Generate max_tokens tokens whatever EOS says (vLLM's).")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=64, description="Token ids that end the answer, kept in it (vLLM's)."
    )

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
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

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        for key in v or {}:
            if not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:40]!r}")
        return v

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias), ids ascending."""
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))

    def grammar(self) -> tuple[str, GrammarSpec | None]:
        """(the field that set it, what the output must match); ValueError for two at once or a
        json_schema format without its schema."""
        found: list[tuple[str, GrammarSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: a json_schema format needs its json_schema")
            found.append(("response_format", GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_))))
        so = self.structured_outputs
        named = [("guided_json", self.guided_json, "json_schema"), ("guided_regex", self.guided_regex, "regex"),
                 ("guided_choice", self.guided_choice, "choice"), ("guided_grammar", self.guided_grammar, "grammar")]
        if so is not None:
            named += [("structured_outputs.json", so.json_, "json_schema"), ("structured_outputs.regex", so.regex, "regex"),
                      ("structured_outputs.choice", so.choice, "choice"),
                      ("structured_outputs.grammar", so.grammar, "grammar")]
        for param, value, kind in named:
            if value is None:
                continue
            source = value if isinstance(value, str) and kind != "choice" else json.dumps(value)
            found.append((param, GrammarSpec(kind, source)))
        if len(found) > 1:
            raise ValueError(f"{found[0][0]} and {found[1][0]}: one structured output at a time")
        return found[0] if found else ("response_format", None)

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


TokenIds = list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


class CompletionRequest(_Common):
    # A text, or token ids (what lm-evaluation-harness sends); one prompt per request.
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Each token's log-probability "
                                 "and this many most likely tokens at its position.")
    echo: StrictBool = Field(False, description="The prompt comes back before the completion (with logprobs: "
                             "the prompt tokens' log-probabilities too).")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Sample this many and return the n "
                                "with the highest log-probability (not with stream).")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_absent(cls, v):
        return None if v is False else v

    @property
    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
        if self.stream and self.best_of is not None and self.best_of > self.n:
            return "best_of", "best_of above n cannot be streamed"
        return super().refuse_unsupported()

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(t, int) for t in v):
            return v  # one prompt of token ids
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
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def refuse_unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        extra = self.model_extra or {}
        for name in ("echo", "best_of"):  # completions' options
            value = extra.get(name)
            if value is not None and value is not False and not (name == "best_of" and value == 1):
                return name, f"'{name}' is only supported by /v1/completions"
        return super().refuse_unsupported()

    @property
    def asked_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass(frozen=True)
class UnitRequest:
    """What the ingress hands the unit across the Ray hop: validated and defaulted once, at the
    HTTP edge (the models above hold OpenAI's defaults); the unit reads it as it is."""

    request_id: str
    prompt: str | list[int] | None  # a text, or token ids
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
    logprobs: int | None = None  # each token's log-probability and this many top ones; None: not asked
    echo: bool = False  # the prompt first (completions), with its tokens' log-probabilities if asked
    n: int = 1  # choices returned
    best_of: int = 1  # choices sampled (>= n; the n most likely are returned)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    user: str | None = None  # the tenant: the trace and the savings it records carry it
    grammar: GrammarSpec | None = None  # structured output
    grammar_param: str = "response_format"  # the field that asked for it (a refusal names it)
    stream: bool = True  # streamed to the client: its tokens leave in chunks of the unit's stream_interval

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
    """One round's new text and token ids (of choice ``index``). ``logprobs``, when asked: per
    token, (its text, its log-probability or None, [(text, log-probability), ...] most likely
    first, or None): the first echoed prompt token has no log-probability."""

    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[tuple[str, float | None, list[tuple[str, float]] | None]] | None = None


def merge_deltas(events: list) -> list:
    """``events`` with each run of consecutive ``Delta``s of one choice joined into one (texts
    and ids; log-probabilities too where the whole run has them): what a reader that fell
    behind sends as one chunk instead of several.

        >>> merge_deltas([Delta("a", [1]), Delta("b", [2]), Delta("c", [3], index=1)])
        [Delta(text='ab', token_ids=[1, 2], index=0, logprobs=None), Delta(text='c', token_ids=[3], index=1, logprobs=None)]
    """
    out: list = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Delta) and isinstance(last, Delta) and last.index == event.index \
                and (last.logprobs is None) == (event.logprobs is None):
            logprobs = None if event.logprobs is None else [*last.logprobs, *event.logprobs]
            out[-1] = Delta(last.text + event.text, [*last.token_ids, *event.token_ids], event.index, logprobs)
        else:
            out.append(event)
    return out


@dataclass(frozen=True)
class End:
    """Choice ``index`` finished: why, what it used, and what speculation did (``speculation``:
    ``SpeculationSummary`` fields plus the controller's summary)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculation: dict
    trace_id: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the unit's prefix cache
    index: int = 0


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
