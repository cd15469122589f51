"""Server-sent events from an OpenAI-style ``/v1/completions`` stream, and their timings.

Pure functions, no I/O: ``sse_data`` turns lines into event payloads, ``completion_chunks``
into JSON chunks up to ``data: [DONE]``, and ``stream_timing`` turns timestamped chunks into
the figures a client sees:

- TTFT: from sending the request to the first chunk that carries output text;
- TPOT: the time per output token after the first, ``(t_last - t_first) / (tokens - 1)``,
  where a speculative round may deliver several tokens in one chunk;
- tokens: ``usage.completion_tokens`` of the last chunk (else the number of text chunks);
  the token ids too where the server sends them (``choices[].token_ids``).

Worked example: request sent at t = 10.0; text chunks at 10.2, 10.3, 10.5; usage says 5
tokens. TTFT = 0.2 s, TPOT = (10.5 - 10.2) / 4 = 0.075 s, total = 0.5 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

DONE = "[DONE]"


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` payload of each event: ``data:`` lines joined by newlines, ended by a
    blank line (or the end of the stream). Comments (``:``) and other fields are skipped."""
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def completion_chunks(lines: Iterable[str]) -> Iterator[dict]:
    """JSON chunks of a completion stream up to ``[DONE]``; an ``error`` chunk, or a stream
    that ends without ``[DONE]`` (a dropped connection), raises."""
    for payload in sse_data(lines):
        if payload.strip() == DONE:
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"server error in stream: {chunk['error']}")
        yield chunk
    raise RuntimeError("the stream ended without data: [DONE]")


def chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    return "".join(c.get("text") or "" for c in choices)


@dataclass(frozen=True)
class StreamTiming:
    ttft_s: float | None
    tpot_s: float | None
    total_s: float
    completion_tokens: int
    prompt_tokens: int | None
    text: str
    speculation: dict | None  # the server's per-request speculation statistics
    finish_reason: str | None
    token_ids: list[int] | None = None  # when the server returns them (``return_token_ids``)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.total_s if self.total_s > 0 else 0.0


def stream_timing(sent_at: float, chunks: Iterable[tuple[float, dict]], ended_at: float | None = None) -> StreamTiming:
    """Figures of one stream from ``(arrival time, chunk)`` pairs (clock of ``sent_at``)."""
    first = last = None
    texts: list[str] = []
    token_ids: list[int] = []
    has_ids = False
    text_chunks = 0
    usage = speculation = finish = None
    last_arrival = sent_at
    for at, chunk in chunks:
        last_arrival = at
        text = chunk_text(chunk)
        if text:
            texts.append(text)
            text_chunks += 1
            first = at if first is None else first
            last = at
        for choice in chunk.get("choices") or []:
            finish = choice.get("finish_reason") or finish
            if choice.get("token_ids") is not None:
                has_ids = True
                token_ids.extend(int(t) for t in choice["token_ids"])
        usage = chunk.get("usage") or usage
        speculation = chunk.get("speculation") or speculation
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else text_chunks
    ttft = first - sent_at if first is not None else None
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    end = ended_at if ended_at is not None else last_arrival
    return StreamTiming(
        ttft_s=ttft,
        tpot_s=tpot,
        total_s=end - sent_at,
        completion_tokens=tokens,
        prompt_tokens=int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None,
        text="".join(texts),
        speculation=speculation,
        finish_reason=finish,
        token_ids=token_ids if has_ids else None,
    )
