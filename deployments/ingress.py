"""Ingress: the OpenAI-style HTTP API (FastAPI), one streaming router call per request
(``ingress: in_unit`` runs this same class inside the unit: ``deployments.unit_ingress``)."""


import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import auth, limits, proxy
from deployments.config import RequestLimits
from deployments.protocol import (
    ChatCompletionRequest, CompletionRequest, Delta, End, Error, Start, UnitEvent, UnitRequest, error_body,
)
from specdec import telemetry

log = logging.getLogger("ray.serve")

app = FastAPI(title="specdec", description="Exact speculative decoding, OpenAI-style API")


class Disconnects:
    """ASGI middleware: a client that hangs up is a disconnect, not an error.

    When a client goes away, Serve's proxy cancels the request, and the replica's ``receive``
    raises ``TaskCancelledError`` where ASGI promises ``http.disconnect``. A streaming response
    listens on ``receive`` for exactly that, so the error escapes its task group and Serve logs
    an ``ExceptionGroup`` traceback for a request nothing went wrong with. Here it becomes the
    disconnect message, the stream stops as Starlette stops any stream whose client left (the
    unit's generation is cancelled with it), and the log gets one line.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                request_id = serve.context._get_serve_request_context().request_id
                log.info("request %s: the client disconnected", request_id)
                return {"type": "http.disconnect"}

        return await self.app(scope, receive_or_disconnect, send)


app.add_middleware(limits.BodyLimit)
app.add_middleware(auth.Authenticate)  # a caller without a key learns nothing
app.add_middleware(Disconnects)  # added last: outermost, it sees Serve's receive first


def _error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, type_=type_, param=param, code=code), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "literal", "none"}


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # A union (e.g. content: str | list of text parts) reports one error per member; the deepest
    # says most ("messages.0.content.0.type: Input should be 'text'").
    first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
    # Union members show up in the location as type tags ("str", "list[str]"): not fields.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _TYPE_TAGS and "[" not in str(p)]
    if first.get("type") == "json_invalid":
        return _error(400, "the request body is not valid JSON", code="invalid_json")
    if loc == [] and first.get("type") in ("model_attributes_type", "dict_type"):
        return _error(400, "the request body must be a JSON object", code="invalid_json")
    param = ".".join(loc) or None
    return _error(400, f"{param or 'body'}: {first.get('msg')}", param=param, code="invalid_value")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail))


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class _Choice:
    """What one choice has said so far."""

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # Delta.logprobs entries
        self.end: End | None = None
        self.offset = 0  # completions' text_offset: characters before the next token


class _Response:
    """Assembles OpenAI completion / chat completion objects from the router's events."""

    def __init__(self, request_id: str, model: str, chat: bool, return_token_ids: bool, start: Start,
                 include_usage: bool = False, fingerprint: str | None = None, n: int = 1,
                 logprobs: bool = False):
        self.id, self.model, self.chat = request_id, model, chat
        self.fingerprint = fingerprint
        self.return_token_ids, self.include_usage = return_token_ids, include_usage
        self.logprobs = logprobs
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(n)]
        self.discarded: list[End] = []  # best_of's choices not returned: generated, so in usage
        self.error: Error | None = None
        self.mode = start.mode

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def ends(self) -> list[End]:
        return [c.end for c in self.choices if c.end is not None]

    @property
    def end(self) -> End | None:
        """The last choice's end, once every choice has ended."""
        ends = self.ends
        return ends[-1] if len(ends) == len(self.choices) else None

    def add(self, event: UnitEvent) -> None:
        if isinstance(event, Delta):
            choice = self.choices[event.index]
            choice.text.append(event.text)
            choice.token_ids.extend(event.token_ids)
            choice.logprobs.extend(event.logprobs or ())
        elif isinstance(event, End) and event.index < 0:
            self.discarded.append(event)
        elif isinstance(event, End):
            self.choices[event.index].end = event
        elif isinstance(event, Error):
            self.error = event

    def _usage(self) -> dict:
        """Every generated choice's tokens (best_of's unreturned ones too), the prompt's once."""
        ends = self.ends + self.discarded
        p, c = ends[0].prompt_tokens, sum(e.completion_tokens for e in ends)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": ends[0].cached_tokens},
                **savings([e.speculation for e in ends], c)}

    @staticmethod
    def _finish(end: End) -> str:
        reason = end.finish_reason
        return reason if reason in ("stop", "length") else "stop"

    def _logprobs(self, choice: _Choice, entries: list) -> dict | None:
        """OpenAI's logprobs object for ``entries`` (Delta.logprobs items)."""
        if not self.logprobs:
            return None
        if self.chat:
            def one(text, lp):
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**one(text, lp), "top_logprobs": [one(t, v) for t, v in top or ()]}
                                for text, lp, top in entries], "refusal": None}
        offsets = []
        for text, _, _ in entries:
            offsets.append(choice.offset)
            choice.offset += len(text)
        return {"tokens": [text for text, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else dict(top) for _, _, top in entries],
                "text_offset": offsets}

    def _choice(self, index: int) -> dict:
        choice = self.choices[index]
        text = "".join(choice.text)
        if self.chat:
            out = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            out = {"index": index, "text": text}
        out["logprobs"] = self._logprobs(choice, choice.logprobs)
        out["finish_reason"] = self._finish(choice.end)
        if self.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out

    def final(self) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [self._choice(i) for i in range(len(self.choices))],
            "usage": self._usage(),
            "speculation": self.ends[0].speculation,  # the first choice's (each choice's chunks carry its own)
        }

    def _chunk(self, index: int, text: str, token_ids: list[int] | None, finish: str | None, first: bool = False,
               logprobs: list | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = self._logprobs(self.choices[index], logprobs) if logprobs else None
        choice["finish_reason"] = finish
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice]}

    async def sse(self, events):
        """The stream's chunks; it always ends with ``[DONE]``, after an error object if the
        unit failed (even if its replica died mid-stream)."""
        first = set(range(len(self.choices)))
        try:
            async for event in events:
                self.add(event)
                if isinstance(event, Delta):
                    yield _sse(self._chunk(event.index, event.text, event.token_ids, None, event.index in first,
                                           event.logprobs))
                    first.discard(event.index)
                elif isinstance(event, End) and event.index >= 0:
                    last = self._chunk(event.index, "", [], self._finish(event))
                    last["speculation"] = event.speculation
                    yield _sse(last)
                elif isinstance(event, Error):
                    yield _sse(error_body(event.message, type_="server_error"))
        except Exception as exc:  # the router replica died or the call failed
            log.warning("stream %s failed: %s", self.id, type(exc).__name__)
            yield _sse(error_body(_unit_failed(exc), type_="server_error", code="unit_failed"))
        if self.end is not None and self.include_usage:  # OpenAI: one more chunk, no choices, the usage
            usage = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
                     "choices": [], "usage": self._usage()}
            yield _sse(usage)
        yield _sse("[DONE]")


def savings(speculation: list[dict], completion_tokens: int) -> dict:
    """What speculation did for these choices, in billing terms: OpenAI's prediction-token
    details (drafted tokens the target kept and threw away), and the target's forward passes
    against the plain-decoding count (one per output token)."""
    drafted = sum(s.get("drafted_tokens", 0) for s in speculation)
    accepted = sum(s.get("accepted_tokens", 0) for s in speculation)
    passes = sum(s.get("rounds", 0) + 1 for s in speculation)  # decode rounds + the prefill's
    plain = completion_tokens
    return {"completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted},
            "speculation": {"target_passes": passes, "plain_passes": plain, "passes_saved": plain - passes,
                            "drafted_tokens": drafted, "accepted_tokens": accepted}}


@dataclass(frozen=True)
class _Unit:
    """Where requests for one model go, and what their responses say."""

    router: DeploymentHandle
    name: str  # the model's first name: responses carry it


def _model_not_found(name: str) -> JSONResponse:
    shown = name[:200].encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates too
    return _error(404, f"the model '{shown}' does not exist", param="model", code="model_not_found")


def _unit_failed(exc: BaseException) -> str:
    return f"the unit serving this request failed ({type(exc).__name__}); the request can be retried"


def _unavailable(exc: BaseException) -> JSONResponse:
    response = _error(503, _unit_failed(exc), code="unit_failed")
    response.headers["retry-after"] = "1"
    return response


def _unit_request(body, inputs: dict, http: Request, request_id: str, grammar: tuple) -> UnitRequest:
    """What the unit is asked for: the parsed body, defaulted once."""
    spec = body.speculation
    return UnitRequest(
        request_id=request_id,
        prompt=inputs.get("prompt"),
        messages=inputs.get("messages"),
        max_tokens=body.limit,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(0, body.top_k),
        seed=body.seed,
        stop=list(body.stop or []),
        ignore_eos=body.ignore_eos,
        stop_token_ids=list(body.stop_token_ids or []),
        min_tokens=body.min_tokens,
        mode=spec.mode if spec else None,
        k=spec.num_speculative_tokens if spec else None,
        # The trace context crosses the Ray hop explicitly: Serve's own span when Serve
        # tracing is on (it already has the caller's traceparent as its parent), else the
        # caller's traceparent header.
        trace_context=telemetry.inject() or telemetry.carrier_from_headers(http.headers),
        logprobs=body.asked_logprobs,
        echo=bool(getattr(body, "echo", False)),
        n=body.n,
        best_of=getattr(body, "best_of", None) or body.n,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=body.bias,
        stream=body.stream,
        user=(body.model_extra or {}).get("user") if isinstance((body.model_extra or {}).get("user"), str) else None,
        grammar_param=grammar[0],
        grammar=grammar[1],
    )


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, routes: list[dict], keys: list[str] | None = None, request_limits: dict | None = None):
        """``routes``: one per unit, ``{"router": handle, "names": [...]}``."""
        auth.set_keys(auth.api_keys(keys))
        limits.set_limits(RequestLimits.model_validate(request_limits or {}))
        if os.environ.get(proxy.CALLBACK_ENV) != proxy.CALLBACK:
            log.warning("%s is not %s: clients can switch off the proxy's request timeout with "
                        "x-request-timeout-seconds", proxy.CALLBACK_ENV, proxy.CALLBACK)
        self.model_names: list[str] = []  # every unit's names, in order
        self.units: dict[str, _Unit] = {}  # by every name a client may send
        for route in routes:
            unit = _Unit(route["router"].options(stream=True), route["names"][0])
            for name in route["names"]:  # aliases: responses carry the unit's first name
                self.units[name] = unit
                self.model_names.append(name)
        self.created = int(time.time())

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specdec",
                "root": self.units[name].name}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [self._card(name) for name in self.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        if model_id not in self.model_names:
            return _model_not_found(model_id)
        return self._card(model_id)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, {"prompt": body.prompt}, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        return await self._serve(body, {"messages": messages}, request, chat=True)

    async def _serve(self, body, inputs: dict, http: Request, *, chat: bool):
        unit = self.units.get(body.model)
        if unit is None:
            return _model_not_found(body.model)
        if refused := body.refuse_unsupported():
            return _error(400, refused[1], param=refused[0], code="unsupported")
        if broken := limits.check_request(body, limits.current()):
            return _error(400, broken[1], param=broken[0], code="limit_exceeded")
        try:
            grammar = body.grammar()
        except ValueError as exc:
            return _error(400, str(exc), param="response_format", code="invalid_value")
        # Serve's request id (a client's x-request-id, or one the proxy made) is echoed in the
        # x-request-id response header by Serve itself; our object ids carry it too.
        serve_id = serve.context._get_serve_request_context().request_id or uuid.uuid4().hex
        request_id = ("chatcmpl-" if chat else "cmpl-") + serve_id
        req = _unit_request(body, inputs, http, request_id, grammar)
        events = unit.router.generate.remote(req)
        try:
            first = await events.__anext__()
        except BackPressureError as exc:  # the unit's queue is full: say when to retry
            # Status and Retry-After as the SpecRouter's backpressure_config sets them.
            response = _error(exc.status_code, f"the server is at capacity ({exc.message})", code="overloaded")
            response.headers["retry-after"] = str(math.ceil(exc.retry_after_s or 1))
            return response
        except Exception as exc:  # the router replica died before answering: nothing was generated
            log.warning("request %s failed: %s", request_id, type(exc).__name__)
            return _unavailable(exc)
        if isinstance(first, Error):
            return _error(first.status, first.message, param=first.param, code=first.code)
        headers = {"x-specdec-mode": first.mode}
        if first.traceparent:  # the request span: find it with `specdec traces show`
            headers["traceparent"] = first.traceparent
        # The fingerprint comes from the replica that answers: in a rolling upgrade, old and new
        # configurations answer side by side.
        response = _Response(request_id, unit.name, chat, body.return_token_ids, first,
                             body.include_usage, first.fingerprint, n=body.n,
                             logprobs=body.asked_logprobs is not None)
        if body.stream:
            return StreamingResponse(
                response.sse(events), media_type="text/event-stream", headers=headers
            )
        try:
            async for event in events:
                response.add(event)
        except Exception as exc:  # the router replica died mid-request: the client got nothing yet
            log.warning("request %s failed: %s", request_id, type(exc).__name__)
            return _unavailable(exc)
        if response.error:
            return _error(500, response.error.message)
        return JSONResponse(response.final(), headers=headers)
