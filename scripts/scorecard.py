"""The "safe to expose" scorecard against a running server, as a client would see it.

    python scripts/scorecard.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct [--key KEY]

Each row sends the request of one case and prints what came back (status, error param or the
check, seconds). With --key the server is expected to require that API key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--key", default=None)
    parser.add_argument("--overload", type=int, default=240, help="concurrent requests for the overload row")
    args = parser.parse_args()
    auth = {"authorization": f"Bearer {args.key}"} if args.key else {}
    client = httpx.Client(base_url=args.url, timeout=600, headers=auth)
    base = {"model": args.model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    rows: list[tuple[str, str]] = []

    def row(case: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # a row that crashes is a result too
            result = f"EXCEPTION {type(exc).__name__}: {exc}"
        rows.append((case, f"{result} ({time.perf_counter() - t0:.2f} s)"))
        print(f"| {case} | {rows[-1][1]} |", flush=True)

    def status(r: httpx.Response) -> str:
        try:
            err = r.json().get("error")
        except (json.JSONDecodeError, AttributeError):
            return f"{r.status_code} NOT JSON: {r.text[:80]!r}"
        return f"{r.status_code}" + (f" error param={err['param']} code={err['code']}" if err else "")

    greedy = client.post("/v1/completions", json=base).json()["choices"][0]["token_ids"]
    row("temperature 1e-300", lambda: (lambda r: f"{status(r)}, greedy tokens: "
        f"{r.json()['choices'][0]['token_ids'] == greedy}")(client.post("/v1/completions", json={**base, "temperature": 1e-300})))
    row("model lone surrogate", lambda: status(client.post(
        "/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}', headers={"content-type": "application/json"})))
    huge = json.dumps({**base, "prompt": "x" * 20_000_000}).encode()
    row("20 MB prompt", lambda: status(client.post("/v1/completions", content=huge,
                                                   headers={"content-type": "application/json"})))
    for name, value in (("presence_penalty", 2), ("response_format", {"type": "json_object"})):
        row(f"{name}", lambda n=name, v=value: status(client.post("/v1/completions", json={**base, n: v})))
    row("ignore_eos, max_tokens 64", lambda: (lambda r: f"{status(r)}, completion_tokens "
        f"{r.json()['usage']['completion_tokens']}")(client.post(
            "/v1/completions", json={**base, "max_tokens": 64, "ignore_eos": True})))
    row("logit_bias {}", lambda: status(client.post("/v1/completions", json={**base, "logit_bias": {}})))
    chat = {"model": args.model, "max_tokens": 8, "temperature": 0}
    row("chat text parts", lambda: (lambda a, b: f"{status(b)}, same as a string: "
        f"{a.json()['choices'] == b.json()['choices']}")(
        client.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "hello there"}]}),
        client.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]})))
    row("Authorization: Bearer wrong", lambda: status(httpx.post(
        f"{args.url}/v1/completions", json=base, headers={"authorization": "Bearer wrong"}, timeout=60)))
    row("same x-request-id twice at once", lambda: _same_request_id(args, auth, base))
    row("200-digit seed", lambda: status(client.post("/v1/completions", json={**base, "seed": 10**200})))
    row("5 stop strings of 100,000 chars", lambda: status(client.post(
        "/v1/completions", json={**base, "stop": ["z" * 100_000] * 5})))
    row("x-request-timeout-seconds: 0.000001", lambda: status(client.post(
        "/v1/completions", json=base, headers={"x-request-timeout-seconds": "0.000001"})))
    row(f"overload: {args.overload} at once", lambda: asyncio.run(_overload(args, auth, base)))


def _same_request_id(args, auth, base) -> str:
    prompts = ["def fibonacci(n):", "The three largest rivers are"]

    async def one(client, prompt):
        r = await client.post("/v1/completions", json={**base, "prompt": prompt, "max_tokens": 24},
                              headers={"x-request-id": "same-id"})
        return r.json()["choices"][0]["token_ids"]

    async def run():
        async with httpx.AsyncClient(base_url=args.url, timeout=600, headers=auth) as client:
            solo = [await one(client, p) for p in prompts]
            both = await asyncio.gather(*(one(client, p) for p in prompts))
            return solo, both

    solo, both = asyncio.run(run())
    return f"each equals its solo output: {solo == list(both)}"


async def _overload(args, auth, base) -> str:
    body = {**base, "max_tokens": 32, "ignore_eos": True}

    async def one(client):
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.headers.get("retry-after"), time.perf_counter() - t0

    async with httpx.AsyncClient(base_url=args.url, timeout=600, headers=auth,
                                 limits=httpx.Limits(max_connections=args.overload)) as client:
        results = await asyncio.gather(*(one(client) for _ in range(args.overload)))
    counts: dict[int, int] = {}
    for code, _, _ in results:
        counts[code] = counts.get(code, 0) + 1
    refused = [s for c, ra, s in results if c in (429, 503) and ra]
    served = [s for c, _, s in results if c == 200]
    return (f"statuses {dict(sorted(counts.items()))}; refusals with Retry-After {len(refused)}, slowest "
            f"{max(refused, default=0):.2f} s; served p50 {sorted(served)[len(served) // 2] if served else 0:.1f} s")


if __name__ == "__main__":
    main()
