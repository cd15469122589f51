"""The HTTP side of the benchmark: streamed completions from a running server (httpx).

The server speaks the OpenAI completions API with extensions: a ``speculation`` object in
the request (``mode``, ``num_speculative_tokens``) and in the last chunk (``mode, rounds,
drafted_tokens, accepted_tokens, acceptance_rate, mean_accepted_length``), and
``return_token_ids`` (asked for, so that greedy HTTP output can be checked token for token
against in-process plain decoding; a server without it ignores or refuses the field:
``--http-extra '{"return_token_ids": false}'`` turns it off). One client per
thread; the concurrency sweep runs ``concurrency`` threads each sending its share of requests
back to back and reports aggregate tokens/s (all output tokens over the wall time) next to
per-request TTFT and TPOT percentiles.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from specdec.bench.progress import SILENT, Phase
from specdec.bench.sse import StreamTiming, completion_chunks, stream_timing
from specdec.bench.workloads import Prompt
from specdec.stats import percentile

log = logging.getLogger(__name__)


class CompletionClient:
    def __init__(self, url: str, *, model: str | None = None, timeout_s: float = 600.0,
                 extra_body: dict | None = None):
        import httpx

        self.url = url.rstrip("/")
        self.extra_body = dict(extra_body or {})
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)
        self.model = model or self.model_name()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "CompletionClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model_name(self) -> str:
        """The first model ``GET /v1/models`` lists."""
        r = self._http.get("/v1/models")
        r.raise_for_status()
        models = r.json().get("data") or []
        if not models:
            raise RuntimeError(f"{self.url}/v1/models lists no model")
        return models[0]["id"]

    def request_body(self, prompt: Prompt, max_tokens: int, mode: str, k: int | None) -> dict:
        speculation: dict = {"mode": mode}
        if k is not None and mode != "off":
            speculation["num_speculative_tokens"] = k
        body = {
            "model": self.model,
            "prompt": prompt.text,
            "max_tokens": max_tokens,
            "temperature": prompt.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},  # the token count comes in a last chunk
            "speculation": speculation,
        }
        if prompt.temperature > 0:
            body["seed"] = prompt.seed
        return {**body, "return_token_ids": True, **self.extra_body}

    def complete(self, prompt: Prompt, max_tokens: int, mode: str, k: int | None) -> StreamTiming:
        """One streamed completion, timed from just before the request is sent."""
        body = self.request_body(prompt, max_tokens, mode, k)
        sent = time.perf_counter()
        with self._http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"POST {self.url}/v1/completions: HTTP {r.status_code}: {r.text[:500]}")
            # Each chunk is stamped as it is parsed, i.e. when it arrived.
            stamped = ((time.perf_counter(), chunk) for chunk in completion_chunks(r.iter_lines()))
            return stream_timing(sent, stamped, ended_at=None)


def concurrency_sweep(
    url: str, model: str, prompts: list[Prompt], levels: list[int], *, requests_per_stream: int,
    max_tokens: int, mode: str, k: int | None, extra_body: dict | None = None, phase: Phase = SILENT,
) -> list[dict]:
    """For each level, ``level`` streams at once, each sending ``requests_per_stream`` requests
    (``phase`` counts them)."""
    if not prompts:
        raise ValueError("the concurrency sweep needs prompts")
    rows = []
    for level in levels:
        results: list[StreamTiming] = []
        errors: list[str] = []
        lock = threading.Lock()
        phase.now(f"{mode}, {level} streams")

        def stream(i: int) -> None:
            with CompletionClient(url, model=model, extra_body=extra_body) as client:
                for j in range(requests_per_stream):
                    prompt = prompts[(i * requests_per_stream + j) % len(prompts)]
                    try:
                        timing = client.complete(prompt, max_tokens, mode, k)
                    except Exception as exc:  # counted and reported, the sweep goes on
                        with lock:
                            errors.append(f"{type(exc).__name__}: {exc}")
                    else:
                        with lock:
                            results.append(timing)
                    phase.advance()

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=level) as pool:
            list(pool.map(stream, range(level)))
        wall = time.perf_counter() - start
        tokens = sum(r.completion_tokens for r in results)
        if errors:
            log.warning("concurrency %d: %d request(s) failed, first: %s", level, len(errors), errors[0])
        rows.append({
            "concurrency": level,
            "requests": len(results),
            "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "wall_s": wall,
            "output_tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "per_stream_tokens_per_s_p50": percentile([r.tokens_per_s for r in results], 50),
            "ttft_s": {"p50": percentile([r.ttft_s for r in results], 50),
                       "p95": percentile([r.ttft_s for r in results], 95)},
            "tpot_s": {"p50": percentile([r.tpot_s for r in results], 50),
                       "p95": percentile([r.tpot_s for r in results], 95)},
        })
    return rows


def run_http(client: CompletionClient, cfg, prompt: Prompt, max_tokens: int, repeat: int):
    """One single-stream request as a ``RunResult`` (no per-round stats; ids if the server sent them)."""
    from specdec.bench.inproc import RunResult

    timing = client.complete(prompt, max_tokens, cfg.mode, cfg.k)
    return RunResult(
        config=cfg.name, prompt=prompt.key, workload=prompt.workload, repeat=repeat, output_ids=timing.token_ids,
        output_tokens=timing.completion_tokens, seconds=timing.total_s, ttft_s=timing.ttft_s,
        speculation=timing.speculation,
    )
