"""Concurrency sweep: aggregate output tokens/s, time per output token and TTFT under load.

``c`` concurrent streams each send ``requests`` greedy requests back to back, all at once, to
one unit: in process (threads over one ``Engine``: its step loop batches them) or through
HTTP (``--url``, a running server). For each mode (``off``, ``auto`` by default) and each
level it prints aggregate output tokens/s, p50 / p95 time per output token (after the first)
and p50 / p95 time to first token, side by side, and optionally plots them.

    specdec sweep --concurrency 1,2,4,8,16 --max-tokens 64 --plot sweep.png
    specdec sweep --http --plot sweep.png     # then the same through HTTP, on a local Serve it starts
    specdec sweep --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct   # a running server only

With ``--http`` one run measures both, side by side: the in-process engine first, then a
local Ray Serve application of the same models (``in_process`` colocation) on 127.0.0.1.

Every row also says where the CPU went: the CPU time each process on this machine used during
the row's turns, per output token, summed by name (``cpu_by_process``; the sweep's own process,
the client and in process also the engine, is ``client``). Through HTTP on a small CPU that is
the point: the model's threads share the cores with the Ingress, the proxy and Ray's own
processes, and every millisecond those take stalls a parallel region of the step.

``--peer URL`` sweeps another OpenAI-style server (llama.cpp's, say) through HTTP in the same
turns as our modes, each level's turns alternating between them, so that the machine's drift
(on a 2-core AMD EPYC with AVX-512 BF16, the demo target's 4-row plain step took 33-41 ms
in most turns of one run and 61 ms in another) hits both alike: its row is named
``--peer-name``, and each of our rows carries ``vs_peer``, the median of its turns' ratios to
the peer's turn beside it.

    specdec sweep --http --peer http://127.0.0.1:8080 --peer-name llama.cpp --repeats 4

Each row is printed to stdout as JSON when its level ends; the phases (load, warm-up, the
requests of every level and mode) show on stderr on a terminal or with ``--progress``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass

from specdec import compute
from specdec.bench.progress import QUIET, SILENT, Phase, Progress, add_progress_argument
from specdec.plugins import local_server

WORKLOAD_PROMPTS = {
    "chat": ["Name three rivers and say where each one flows.", "Explain what a hash table is.",
             "Give me two tips for learning to cook.", "What is the capital of France, and why is it famous?"],
    "code": ["def fibonacci(n):", "def quicksort(xs):", "class Stack:\n    def __init__(self):",
             "def read_csv(path):"],
}


@dataclass
class Sample:
    tokens: int
    ttft_s: float
    total_s: float

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / max(1, self.tokens - 1)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else 0.0


def run_level(send, concurrency: int, requests: int, prompts: list[str], meter=None) -> dict:
    """``concurrency`` streams x ``requests`` each; ``send(prompt) -> Sample``. ``meter() ->
    {name: CPU seconds}`` (``cpu_by_process``), read before and after: the row's
    ``cpu_ms_per_token`` by name, the names that used any."""
    samples: list[Sample] = []
    lock = threading.Lock()

    def stream(i: int) -> None:
        for r in range(requests):
            s = send(prompts[(i + r * concurrency) % len(prompts)])
            with lock:
                samples.append(s)

    before = meter() if meter else None
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    row = {
        "concurrency": concurrency, "requests": len(samples), "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tpot_ms_p50": 1e3 * _pct([s.tpot_s for s in samples], 0.5),
        "tpot_ms_p95": 1e3 * _pct([s.tpot_s for s in samples], 0.95),
        "ttft_ms_p50": 1e3 * _pct([s.ttft_s for s in samples], 0.5),
        "ttft_ms_p95": 1e3 * _pct([s.ttft_s for s in samples], 0.95),
    }
    if meter:
        used = {name: seconds - before.get(name, 0.0) for name, seconds in meter().items()}
        row["cpu_ms_per_token"] = {name: 1e3 * seconds / max(1, tokens)
                                   for name, seconds in sorted(used.items(), key=lambda kv: -kv[1]) if seconds > 0}
    return row


def process_name(title: str) -> str:
    """A process's name for ``cpu_by_process``, from its title (``cmdline[0]``): a Ray worker is
    its actor (``ray::ServeReplica:<app>:<deployment>`` its deployment; a method it runs, as in
    ``ray::ServeController.listen_for_change``, is left out), anything else its executable."""
    if title.startswith("ray::"):
        actor = title[len("ray::"):].split(" ", 1)[0].split(".", 1)[0]
        return actor.rsplit(":", 1)[-1]
    return os.path.basename(title.split(" ", 1)[0])


def cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) used so far by every process on this machine (not the
    kernel's threads), summed by ``process_name``; this process is ``client``."""
    import psutil

    me, used = os.getpid(), collections.Counter()
    for proc in psutil.process_iter():
        try:
            cmdline = proc.cmdline()
            if not cmdline:  # a kernel thread
                continue
            name = "client" if proc.pid == me else process_name(cmdline[0])
            times = proc.cpu_times()
            used[name] += times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return dict(used)


def in_process_sender(engine, mode: str, max_tokens: int, chat: bool):
    def send(prompt: str) -> Sample:
        ids = engine.encode(messages=[{"role": "user", "content": prompt}]) if chat else engine.encode(prompt=prompt)
        res = engine.generate(ids, max_tokens=max_tokens, mode=mode, ignore_eos=True)
        return Sample(len(res.token_ids), res.ttft_s, res.total_s)
    return send


def http_sender(url: str, model: str, mode: str, max_tokens: int, chat: bool):
    """A greedy streamed request to ``url`` (``ignore_eos``, ``speculation.mode`` as ours reads
    them). A request the server dropped before answering (a keep-alive connection it closed
    while the sender was idle: llama.cpp's server between turns) is sent once more, on a new
    connection: nothing had been generated for it, and a lost request would leave the turn's
    stream a request short."""
    import httpx

    client = httpx.Client(base_url=url, timeout=600)

    def send(prompt: str) -> Sample:
        try:
            return attempt(prompt)
        except (httpx.RemoteProtocolError, httpx.ConnectError) as exc:
            if getattr(exc, "answered", False):
                raise
            return attempt(prompt)

    def attempt(prompt: str) -> Sample:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "speculation": {"mode": mode}}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        with client.stream("POST", path, json=body) as r:
            r.raise_for_status()
            try:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if ttft is None and chunk["choices"] and chunk["choices"][0].get("finish_reason") is None:
                        ttft = time.perf_counter() - t0
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            except (httpx.RemoteProtocolError, httpx.ConnectError) as exc:
                exc.answered = True  # cut mid-answer: not sent again
                raise
        total = time.perf_counter() - t0
        return Sample(tokens, ttft if ttft is not None else total, total)
    return send


def sweep(make_sender, modes: list[str], levels: list[int], requests: int, prompts: list[str],
          phase: Phase = SILENT, repeats: int = 1, meter=None, peer: str | None = None) -> list[dict]:
    """One row per (level, mode), printed as JSON as its level ends; ``phase`` counts the
    requests (``requests_total``).

    Each level runs every mode ``repeats`` times, in turns whose order alternates (off, auto,
    auto, off, ...), so that a drift of the machine's speed hits every mode alike; a row's
    figures are the medians over its turns. With several turns, a row other than ``off`` also
    carries ``vs_off``: the median of its turns' ratios to ``off``'s turn beside it, and
    ``vs_off_range``, their smallest and largest (how far one run could have misled).
    ``peer``: the mode among ``modes`` that is another server (``--peer``); every other row
    carries ``vs_peer`` and ``vs_peer_range`` the same way (with one turn, the one ratio).
    """
    rows = []
    for level in levels:
        turns: dict[str, list[dict]] = {m: [] for m in modes}
        for turn in range(repeats):
            for mode in (modes if turn % 2 == 0 else modes[::-1]):
                phase.now(f"{mode}, {level} streams x {requests}" + (f", turn {turn + 1}/{repeats}" * (repeats > 1)))
                turns[mode].append(run_level(phase.counting(make_sender(mode)), level, requests, prompts, meter))
        for mode in modes:
            row = {"mode": mode, **_medians(turns[mode])}
            if repeats > 1 and "off" in turns and mode not in ("off", peer):
                row["vs_off"], row["vs_off_range"] = _paired(turns[mode], turns["off"])
            if peer in turns and mode != peer:
                row["vs_peer"], row["vs_peer_range"] = _paired(turns[mode], turns[peer])
            rows.append(row)
            phase.print_stdout(json.dumps(row))
    return rows


def _paired(turns: list[dict], others: list[dict]) -> tuple[float, list[float]]:
    """The median of the ratios of ``turns``' tokens/s to those of the turns beside them, and
    the smallest and largest ratio."""
    ratios = sorted(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(turns, others))
    return statistics.median(ratios), [ratios[0], ratios[-1]]


def _medians(turns: list[dict]) -> dict:
    """One level's turns of one mode as one row: counts summed, rates and latencies their medians,
    each turn's tokens/s kept (``turns_tokens_per_s``)."""
    if len(turns) == 1:
        return turns[0]
    counts = ("concurrency", "requests", "tokens", "cpu_ms_per_token")
    row = {k: statistics.median(t[k] for t in turns) for k in turns[0] if k not in counts}
    if "cpu_ms_per_token" in turns[0]:  # each name's median over the turns (0 in a turn it was idle)
        names = {n: None for t in turns for n in t["cpu_ms_per_token"]}
        medians = {n: statistics.median(t["cpu_ms_per_token"].get(n, 0.0) for t in turns) for n in names}
        row["cpu_ms_per_token"] = {n: ms for n, ms in sorted(medians.items(), key=lambda kv: -kv[1]) if ms > 0}
    return {"concurrency": turns[0]["concurrency"], "requests": sum(t["requests"] for t in turns),
            "tokens": sum(t["tokens"] for t in turns), **row,
            "turns_tokens_per_s": [t["tokens_per_s"] for t in turns]}


def requests_total(modes: list[str], levels: list[int], requests: int, repeats: int = 1) -> int:
    """The requests ``sweep`` sends."""
    return len(modes) * sum(levels) * requests * repeats


def _warm_up(make_sender, modes: list[str], prompt: str, phase: Phase) -> None:
    for mode in modes:
        phase.now(mode)
        make_sender(mode)(prompt)
        phase.advance()


def _section(progress: Progress, where: str, make_sender, modes: list[str], levels: list[int], requests: int,
             prompts: list[str], warm_up: bool = True, repeats: int = 1, meter=None,
             peer: str | None = None) -> list[dict]:
    """Warm every mode up once (``warm_up``), then sweep: two phases."""
    if warm_up:
        with progress.phase(f"{where}: warm-up", len(modes)) as phase:
            _warm_up(make_sender, modes, prompts[0], phase)
    with progress.phase(where, requests_total(modes, levels, requests, repeats)) as phase:
        return sweep(make_sender, modes, levels, requests, prompts, phase, repeats, meter, peer)


def table(rows: list[dict], where: str) -> str:
    cpu = any("cpu_ms_per_token" in r for r in rows)
    peer = any("vs_peer" in r for r in rows)
    lines = [f"| {where} | c | tok/s | vs off |" + " vs peer |" * peer + " TPOT p50 / p95 ms | TTFT p50 / p95 ms |"
             + " CPU ms per token (the 4 largest) |" * cpu, "|---|---|---|---|---|---|" + "---|" * (cpu + peer)]
    off = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        ratio = r["tokens_per_s"] / off[r["concurrency"]] if off.get(r["concurrency"]) else float("nan")
        vs_off = f"{ratio:.2f}"
        if "vs_off" in r:  # paired turns: the median ratio and its range
            vs_off = f"{r['vs_off']:.2f} ({r['vs_off_range'][0]:.2f}-{r['vs_off_range'][1]:.2f})"
        vs_peer = "-"
        if "vs_peer" in r:  # with one turn, the one ratio
            low, high = r["vs_peer_range"]
            vs_peer = f"{r['vs_peer']:.2f}" + (f" ({low:.2f}-{high:.2f})" if low != high else "")
        line = (f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {vs_off} | "
                + f"{vs_peer} | " * peer
                + f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p95']:.1f} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p95']:.0f} |")
        if cpu:
            largest = list(r.get("cpu_ms_per_token", {}).items())[:4]
            line += " " + ", ".join(f"{name} {ms:.2f}" for name, ms in largest) + " |"
        lines.append(line)
    return "\n".join(lines)


def plot(sections: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for where, rows in sections.items():
        for mode in sorted({r["mode"] for r in rows}):
            mine = [r for r in rows if r["mode"] == mode]
            style = "-" if where == "in process" else "--"
            label = f"{mode} ({where})"
            xs = [r["concurrency"] for r in mine]
            axes[0].plot(xs, [r["tokens_per_s"] for r in mine], style, marker="o", label=label)
            axes[1].plot(xs, [r["tpot_ms_p50"] for r in mine], style, marker="o", label=label)
    axes[0].set(xlabel="concurrent streams", ylabel="aggregate output tokens/s", xscale="log")
    axes[1].set(xlabel="concurrent streams", ylabel="time per output token, p50 (ms)", xscale="log")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="only this running server (no in-process sweep)")
    p.add_argument("--http", action="store_true", help="also sweep through HTTP on a local Serve")
    p.add_argument("--port", type=int, default=8191, help="the local Serve's port (with --http)")
    p.add_argument("--ingress", choices=["separate", "in_unit"], default="in_unit",
                   help="the local Serve's layout (with --http): the unit serving HTTP itself "
                        "(serve_config.yaml's), or an Ingress deployment before the unit (several models)")
    p.add_argument("--stream-interval", type=int, default=4,
                   help="the local Serve's stream_interval (with --http): tokens per streamed chunk "
                        "(serve_config.yaml's 4; 1: a chunk per round)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name (with --url)")
    p.add_argument("--peer", help="another OpenAI-style server (e.g. llama.cpp's) swept through HTTP in the same "
                                  "turns as our modes, alternating with them; our rows carry the paired ratio to it")
    p.add_argument("--peer-name", default="peer", help="the peer's row in the tables (with --peer)")
    p.add_argument("--target", help="target model (default: the demo pair)")
    p.add_argument("--draft", help="draft model (default: the demo pair)")
    p.add_argument("--dtype", default="auto",
                   help="auto: bfloat16 where this machine has native bf16, "
                        "else float16-weights (x86) or float32")
    p.add_argument("--modes", default="off,auto")
    p.add_argument("--numerics", default="batch_invariant",
                   help="the target's numerics, comma-separated to compare them in process (batch_invariant,fast)")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=2, help="requests per stream")
    p.add_argument("--repeats", type=int, default=1,
                   help="turns of every mode per level, in alternating order; several give each ratio to off as the "
                        "median of paired turns, with its range")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", choices=sorted(WORKLOAD_PROMPTS), default="code")
    p.add_argument("--threads", type=int, help="torch threads (default: what torch picks)")
    p.add_argument("--out", help="write the rows as JSON")
    p.add_argument("--plot", help="write a PNG of tokens/s and TPOT against concurrency")
    add_progress_argument(p)


def models_from_args(args) -> dict:
    from specdec.demo import demo_exit_adapter, demo_paths

    if getattr(args, "target", None):
        return {"target": args.target, "draft": args.draft, "dtype": args.dtype}
    paths = demo_paths()
    exit_adapter = demo_exit_adapter()
    return {"target": str(paths["target"]), "draft": str(paths["draft"]), "dtype": args.dtype,
            "draft_dtype": "auto", "early_exit_adapter": str(exit_adapter) if exit_adapter else None,
            "eagle_head": str(paths["eagle"]), "medusa_heads": str(paths["medusa"])}


def run(args, progress: Progress = QUIET) -> dict:
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = args.modes.split(",")
    prompts = WORKLOAD_PROMPTS[args.workload]
    chat = args.workload == "chat"
    sections: dict[str, list[dict]] = {}
    peer = args.peer
    if peer and not (args.url or args.http):
        raise SystemExit("--peer is swept through HTTP: add --http (a local Serve) or --url")
    if peer and args.peer_name in modes:
        raise SystemExit(f"--peer-name {args.peer_name!r} is one of --modes")

    def over_http(url: str, model: str, warm_up: bool) -> list[dict]:
        def sender(mode: str):
            if peer and mode == args.peer_name:
                return http_sender(peer, args.model, "off", args.max_tokens, chat)
            return http_sender(url, model, mode, args.max_tokens, chat)
        return _section(progress, "HTTP", sender, modes + [args.peer_name] * bool(peer), levels, args.requests,
                        prompts, warm_up=warm_up, repeats=args.repeats, meter=cpu_by_process,
                        peer=args.peer_name if peer else None)

    if args.url:
        sections["HTTP"] = over_http(args.url, args.model, warm_up=False)
        return sections
    import torch

    from specdec.config import ModelConfig
    from specdec.engine import Engine

    if args.threads:
        compute.set_threads(args.threads)
    models = models_from_args(args)
    numerics = args.numerics.split(",")
    for numeric in numerics:
        where = "in process" if len(numerics) == 1 else f"in process, numerics {numeric}"
        with progress.phase(f"{where}: load", 1) as phase:
            phase.now(models["target"])
            engine = Engine.load(ModelConfig(**models, numerics=numeric), max_num_seqs=max(levels))
            engine.warm_up()  # as a served unit does before its first request
            phase.advance()
        send = lambda m: in_process_sender(engine, m, args.max_tokens, chat)  # noqa: E731
        sections[where] = _section(progress, where, send, modes, levels, args.requests, prompts,
                                   repeats=args.repeats, meter=cpu_by_process)
        engine.loop.close()
    models["numerics"] = numerics[0]
    if args.http:
        with progress.phase("HTTP: start a local Serve", 1) as phase:
            phase.now(f"127.0.0.1:{args.port}")
            stop = local_server()(models, port=args.port, name="sweep", max_num_seqs=max(levels),
                                  ingress=args.ingress, stream_interval=args.stream_interval)
            phase.advance()
        try:
            sections["HTTP"] = over_http(f"http://127.0.0.1:{args.port}", "sweep", warm_up=True)
        finally:
            stop()
    return sections


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def run_from_args(args) -> int:
    sections = run(args, Progress("sweep", force=args.progress))
    for where, rows in sections.items():
        turns = f", {args.repeats} paired turns a level" if args.repeats > 1 else ""
        print(f"\n{where}, {args.workload}, {args.max_tokens} tokens per request, {args.requests} per stream{turns}")
        print(table(rows, where))
    if args.out:
        with open(args.out, "w") as f:
            options = {k: v for k, v in vars(args).items() if not callable(v)}
            json.dump({"args": options, "sections": sections}, f, indent=2)
    if args.plot:
        plot(sections, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
