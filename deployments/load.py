"""A mixed load for operating tests: streams of OpenAI requests, each one's outcome classified.

An operator's question during an upgrade or a fault is what each client got. ``run_load``
keeps ``streams`` clients busy with a fixed set of request ``Case``s (modes, greedy and seeded
sampling, streaming or not, chat and completions, optionally cancellations and bad requests)
and classifies every response (``Outcome.kind``):

- ``exact``: completed, with the token ids of the case's reference (``references``);
- ``completed``: completed, no reference to compare with (or ``--no-check``);
- ``differs``: completed with other tokens than the reference (a changed answer: a failure);
- ``rerolled``: a seeded sampled request whose drafts failed mid-request (``classify``);
- ``refused``: a 4xx OpenAI error object (the bad requests get these);
- ``error``: a 5xx OpenAI error object (``503 unit_failed``, a stream's error chunk then
  ``[DONE]``): clean, the client knows to retry;
- ``lost``: anything else (a connection cut, a stream that ends without ``[DONE]``, a body
  that is not an OpenAI object): the failure an operator must never see;
- ``cancelled``: the client hung up on purpose.

Every completed response's ``system_fingerprint`` is kept (every chunk of a stream must carry
the same one), so a test can tell which configuration answered. The module imports no Ray.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPTS = ["The cat sees", "My friend builds the old", "Def f1(x): return x +", "A bird hears the tall tree"]


@dataclass(frozen=True)
class Case:
    """One request body, sent as is; ``name`` keys its reference."""

    name: str
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict
    cancel_after: int | None = None  # chunks read before the client hangs up (a stream)
    bad: bool = False  # a request that must be refused with a 4xx error object

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def mixed_cases(model: str, *, modes: tuple[str, ...] = ("off", "auto", "draft", "ngram"), max_tokens: int = 32,
                cancellations: bool = False, bad_requests: bool = False) -> list[Case]:
    """The mix: every prompt in every mode, alternating greedy / seeded sampling, streaming /
    not, completions / chat; optionally streams cancelled after a few chunks and bad bodies."""
    cases = []
    for i, prompt in enumerate(PROMPTS):
        for j, mode in enumerate(modes):
            n = i * len(modes) + j
            body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
                    "stream": n % 2 == 0, "speculation": {"mode": mode}}
            body.update({"temperature": 0} if n % 3 else {"temperature": 0.8, "seed": 1000 + n})
            if n % 4 == 3:
                path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
            else:
                path, body["prompt"] = "/v1/completions", prompt
            cases.append(Case(f"{mode}-{i}-{n}", path, body))
    if cancellations:
        for i, prompt in enumerate(PROMPTS[:2]):
            body = {"model": model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
                    "temperature": 0, "speculation": {"mode": "auto"}}
            cases.append(Case(f"cancel-{i}", "/v1/completions", body, cancel_after=3))
    if bad_requests:
        bad = [{"model": model, "prompt": "x", "max_tokens": -1},
               {"model": model, "prompt": "x", "temperature": "hot"},
               {"model": "no-such-model", "prompt": "x"},
               {"model": model, "messages": []}]
        for i, body in enumerate(bad):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            cases.append(Case(f"bad-{i}", path, body, bad=True))
    return cases


@dataclass
class Outcome:
    case: str
    kind: str  # see the module docstring
    status: int
    started: float  # seconds since the load began
    ended: float
    tokens: list[int] | None = None
    fingerprint: str | None = None
    detail: str = ""
    code: str | None = None
    retry_after: str | None = None


def _is_error_object(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "message" in obj["error"]


def _fingerprints(chunks: list[dict]) -> set:
    return {c.get("system_fingerprint") for c in chunks if c.get("choices")}


@dataclass(frozen=True)
class Reply:
    """What one request got back, before the reference check (``kind``: ``completed``,
    ``refused``, ``error``, ``lost`` or ``cancelled``)."""

    kind: str
    status: int
    tokens: list[int] | None = None
    fingerprint: str | None = None
    detail: str = ""
    speculation: dict | None = None
    code: str | None = None  # an error object's code
    retry_after: str | None = None  # the Retry-After header of an error


def _error(kind: str, status: int, obj: dict, retry_after: str | None = None) -> Reply:
    return Reply(kind, status, detail=obj["error"]["message"], code=obj["error"].get("code"), retry_after=retry_after)


async def send(client: httpx.AsyncClient, base: str, case: Case, headers: dict | None = None) -> Reply:
    url = base.rstrip("/") + case.path
    try:
        if not case.stream:
            r = await client.post(url, json=case.body, headers=headers)
            try:
                obj = r.json()
            except ValueError:
                return Reply("lost", r.status_code, detail=f"not JSON: {r.text[:80]!r}")
            if r.status_code == 200 and "choices" in obj:
                return Reply("completed", 200, obj["choices"][0].get("token_ids"), obj.get("system_fingerprint"),
                             speculation=obj.get("speculation"))
            if _is_error_object(obj):
                return _error("refused" if r.status_code < 500 else "error", r.status_code, obj,
                              r.headers.get("retry-after"))
            return Reply("lost", r.status_code, detail=f"unexpected body {str(obj)[:80]}")
        async with client.stream("POST", url, json=case.body, headers=headers) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    obj = json.loads(raw)
                except ValueError:
                    return Reply("lost", r.status_code, detail=f"not JSON: {raw[:80]!r}")
                if not _is_error_object(obj):
                    return Reply("lost", r.status_code, detail=str(obj)[:120])
                return _error("refused" if r.status_code < 500 else "error", r.status_code, obj,
                              r.headers.get("retry-after"))
            chunks, done, tokens, read = [], False, [], 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                chunks.append(chunk)
                if chunk.get("choices"):
                    tokens += chunk["choices"][0].get("token_ids") or []
                    read += 1
                if case.cancel_after is not None and read >= case.cancel_after:
                    return Reply("cancelled", 200)
            errors = [c for c in chunks if _is_error_object(c)]
            if errors:
                return _error("error" if done else "lost", 200, errors[0])
            if not done:
                return Reply("lost", 200, detail="the stream ended without [DONE]")
            prints = _fingerprints(chunks)
            if len(prints) != 1:
                return Reply("lost", 200, detail=f"fingerprints within one stream: {prints}")
            last = next((c for c in reversed(chunks) if "speculation" in c), {})
            return Reply("completed", 200, tokens, prints.pop(), speculation=last.get("speculation"))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Reply("lost", 0, detail=f"{type(exc).__name__}: {exc}")


def classify(case: Case, reply: Reply, references: dict) -> str:
    """The outcome's kind (module docstring). A seeded sampled request whose drafts failed
    mid-request (``draft_failures``: those rounds ran plainly) is ``rerolled`` when its text
    differs from the reference: which tokens rejection sampling draws depends on how the rounds
    were cut, so the text is a fresh sample of the target's distribution, not the seeded one."""
    if case.bad:
        return "refused" if reply.kind == "refused" else "lost"  # refused, never served or failed
    if reply.kind == "completed" and case.name in references and reply.tokens is not None:
        if reply.tokens == references[case.name]:
            return "exact"
        sampled = case.body.get("temperature", 1.0) > 0
        if sampled and (reply.speculation or {}).get("draft_failures"):
            return "rerolled"
        return "differs"
    return reply.kind


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)  # what Outcome.started counts from

    def counts(self, since: float = 0.0, until: float = float("inf")) -> Counter:
        return Counter(o.kind for o in self.outcomes if since <= o.started < until)

    def failures(self) -> list[Outcome]:
        """What must never happen: a lost request or a changed answer."""
        return [o for o in self.outcomes if o.kind in ("lost", "differs")]

    def fingerprints(self) -> Counter:
        return Counter(o.fingerprint for o in self.outcomes if o.fingerprint)


async def run_load(base: str, cases: list[Case], *, streams: int, stop: asyncio.Event, references: dict | None = None,
                   headers: dict | None = None, seed: int = 0, timeout_s: float = 120.0,
                   report: LoadReport | None = None) -> LoadReport:
    """``streams`` clients, each sending cases drawn at random (seeded) back to back until
    ``stop`` is set; every outcome lands in ``report`` as it happens."""
    report = report if report is not None else LoadReport()
    references = references or {}
    t0 = report.t0

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + index)
        while not stop.is_set():
            case = rng.choice(cases)
            started = time.perf_counter() - t0
            reply = await send(client, base, case, headers)
            report.outcomes.append(Outcome(case.name, classify(case, reply, references), reply.status, started,
                                           time.perf_counter() - t0, reply.tokens, reply.fingerprint, reply.detail,
                                           reply.code, reply.retry_after))
            if reply.kind in ("lost", "error"):
                await asyncio.sleep(0.2)  # a client backs off before retrying

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(streams)))
    return report


async def references_for(base: str, cases: list[Case], headers: dict | None = None) -> dict:
    """Each checkable case's tokens, asked one at a time (the calm before the storm)."""
    refs = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for case in cases:
            if case.bad or case.cancel_after is not None:
                continue
            reply = await send(client, base, case, headers)
            if reply.kind != "completed":
                raise RuntimeError(f"reference {case.name}: {reply.kind} {reply.status} {reply.detail}")
            refs[case.name] = reply.tokens
    return refs
