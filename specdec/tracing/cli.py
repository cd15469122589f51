"""``specdec traces``: the requests in the span files, listed, drawn or summarised.

    specdec traces list [--limit 20] [--since 1h]      recent requests
    specdec traces show TRACE_ID [--all] [--html F]    a waterfall of prefill and rounds
    specdec traces summary [--since 1h]                acceptance and latency distributions
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

from specdec.stats import percentile
from specdec.tracing.format import default_trace_dir
from specdec.tracing.reader import Trace, find_trace, load_traces
from specdec.tracing.view import fmt, format_waterfall, local_time, render_html


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``1h``, ``2d`` (a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ValueError(f"bad duration {text!r}: use e.g. 90s, 30m, 1h, 2d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


# --- list ------------------------------------------------------------------------------


def format_list(traces: list[Trace], limit: int) -> str:
    header = (
        f"{'trace id':<32}  {'time':<19}  {'mode':<6} {'in':>5} {'out':>5} {'rounds':>6} {'accept':>6} "
        f"{'latency ms':>10}  finish"
    )
    lines = [header]
    for t in reversed(traces[-limit:] if limit > 0 else traces):
        lines.append(
            f"{t.trace_id:<32}  {local_time(t.start_ns):<19}  {t.mode:<6} {t.input_tokens or '-':>5} "
            f"{t.output_tokens:>5} "
            f"{len(t.decode_rounds):>6} {fmt(t.acceptance):>6} {t.latency_ms:>10.1f}  {t.finish_reason}"
        )
    return "\n".join(lines)


# --- summary ---------------------------------------------------------------------------


def format_summary(traces: list[Trace], window: str) -> str:
    if not traces:
        return f"no requests in {window}"
    first, last = local_time(traces[0].start_ns), local_time(traces[-1].start_ns)
    lines = [f"{len(traces)} requests in {window} ({first} .. {last})"]
    modes = Counter(t.mode for t in traces)
    lines.append("modes: " + ", ".join(f"{m} {n}" for m, n in modes.most_common()))
    spec = [t for t in traces if t.acceptance is not None]
    rounds = [r for t in traces for r in t.decode_rounds]
    rows = [
        ("latency ms", [t.latency_ms for t in traces]),
        ("TTFT ms", [x for t in traces if (x := t.ttft_ms) is not None]),
        ("tokens/s", [t.tokens_per_s for t in traces]),
        ("acceptance", [t.acceptance for t in spec]),
        ("mean accepted length", [x for t in spec if (x := t.mean_accepted_length) is not None]),
        ("round draft ms", [r.attributes.get("specdec.draft_ms", 0.0) for r in rounds]),
        ("round verify ms", [r.attributes.get("specdec.verify_ms", 0.0) for r in rounds]),
    ]
    lines += ["", f"{'':<22}{'n':>6}{'p50':>10}{'p95':>10}{'mean':>10}{'max':>10}"]
    for name, xs in rows:
        if xs:
            lines.append(
                f"{name:<22}{len(xs):>6}{percentile(xs, 50):>10.2f}{percentile(xs, 95):>10.2f}"
                f"{sum(xs) / len(xs):>10.2f}{max(xs):>10.2f}"
            )
    drafted = [r for r in rounds if r.attributes.get("specdec.drafted", 0)]
    if drafted:
        counts = Counter(r.attributes.get("specdec.accepted", 0) for r in drafted)
        lines += ["", f"accepted drafts per speculative round ({len(drafted)} rounds):"]
        for a in range(max(counts) + 1):
            share = counts[a] / len(drafted)
            lines.append(f"  {a:>3}  {'#' * round(share * 40):<40} {share * 100:5.1f}%")
    return "\n".join(lines + format_savings(traces))


def format_savings(traces: list[Trace]) -> list[str]:
    """What speculation saved, by tenant (the request's ``user``) and model: the target's passes
    against plain decoding's (one per output token)."""
    by: dict[tuple[str, str], list[int]] = {}
    for t in traces:
        passes, plain = t.attr("specdec.target_passes"), t.attr("specdec.plain_passes")
        if passes is None or plain is None:
            continue
        row = by.setdefault((t.attr("enduser.id", "-"), t.attr("gen_ai.request.model", "-")), [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + plain, row[2] + passes
    if not by:
        return []
    lines = ["", "target passes saved by speculation, by user and model:",
             f"  {'user':<20} {'model':<28} {'requests':>8} {'plain':>8} {'used':>8} {'saved':>8}"]
    for (user, model), (n, plain, used) in sorted(by.items()):
        lines.append(f"  {user[:20]:<20} {model[:28]:<28} {n:>8} {plain:>8} {used:>8} "
                     f"{plain - used:>8} ({(plain - used) / plain if plain else 0:.0%})")
    return lines


# --- the CLI ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="traces_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", type=Path, default=None, help="span files (default: $SPECDEC_HOME/traces)")
    ls = sub.add_parser("list", parents=[common], help="recent requests, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--since", default=None, help="only the last 30m, 1h, 2d, ...")
    show = sub.add_parser("show", parents=[common], help="a waterfall of one request's rounds")
    show.add_argument("trace_id", help="a trace id or a unique prefix of one")
    show.add_argument("--all", action="store_true", help="also the draft / verify spans")
    show.add_argument("--width", type=int, default=60)
    show.add_argument("--html", type=Path, default=None, help="write a self-contained timeline page here")
    summary = sub.add_parser("summary", parents=[common], help="acceptance and latency distributions")
    summary.add_argument("--since", default="1h", help="time window: 30m, 1h, 2d, ... (default 1h)")


def run_from_args(args: argparse.Namespace) -> int:
    directory = args.dir or default_trace_dir()
    if args.traces_command == "list":
        since = parse_duration(args.since) if args.since else None
        traces = load_traces(directory, since_s=since)
        print(format_list(traces, args.limit) if traces else f"no traces in {directory}")
    elif args.traces_command == "show":
        trace = find_trace(load_traces(directory), args.trace_id)
        if args.html:
            args.html.write_text(render_html(trace), encoding="utf-8")
            print(f"wrote {args.html}")
        else:
            print(format_waterfall(trace, width=max(20, args.width), show_all=args.all))
    elif args.traces_command == "summary":
        traces = load_traces(directory, since_s=parse_duration(args.since))
        print(format_summary(traces, f"the last {args.since}"))
    sys.stdout.flush()
    return 0
