"""One request's trace drawn: a terminal waterfall (``specdec traces show ID``) and a
self-contained HTML page (``specdec traces show ID --html FILE``).

The page uses inline CSS and SVG only (no scripts, fonts or images fetched), so the file
opens anywhere. A timeline of the request, its prefill and every round (draft then verify), the
draft / verify spans and the policy's events on one time axis; the tokens emitted over time;
the accepted drafts of every round; and a table of the rounds. Hovering any mark shows its attributes.
"""

from __future__ import annotations

import math
import time
from html import escape

from specdec.tracing.reader import SpanRecord, Trace


def local_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# --- show: a terminal waterfall --------------------------------------------------------

DRAFT_CH, VERIFY_CH, OTHER_CH = "=", "#", "-"


def _bar(width: int, origin: int, total: int, segments: list[tuple[int, int, str]]) -> str:
    cells = [" "] * width
    for start, end, ch in segments:
        a = min(width - 1, int((start - origin) / total * width))
        b = max(a + 1, min(width, round((end - origin) / total * width)))
        cells[a:b] = ch * (b - a)
    return "".join(cells)


def _round_label(span: SpanRecord) -> str:
    a = span.attributes
    if span.name == "prefill":
        return "prefill"
    bonus = " +1" if a.get("specdec.bonus") else ""
    accepted = f"{a.get('specdec.accepted', 0)}/{a.get('specdec.k')}{bonus}" if a.get("specdec.k") else ""
    return f"round {a.get('specdec.round', '?'):>3} {a.get('specdec.mode', ''):<6} {accepted}"


def _round_segments(span: SpanRecord) -> list[tuple[int, int, str]]:
    """The round's verify phase, with its draft phase drawn over the start (k > 0 only)."""
    segments = [(span.start_ns, span.end_ns, VERIFY_CH)]
    if span.attributes.get("specdec.k"):
        draft_end = span.start_ns + int(span.attributes.get("specdec.draft_ms", 0) * 1e6)
        segments.append((span.start_ns, draft_end, DRAFT_CH))
    return segments


def _events_lines(span: SpanRecord, indent: str) -> list[str]:
    error = span.attributes.get("specdec.draft_error")
    out = [f"{indent}! the drafter failed: {error}"] if error else []
    for e in span.events:
        attrs = " ".join(f"{k}={v}" for k, v in (e.get("attributes") or {}).items())
        out.append(f"{indent}! {e.get('name')} {attrs}".rstrip())
    return out


def format_waterfall(trace: Trace, *, width: int = 60, show_all: bool = False) -> str:
    origin, total = trace.start_ns, max(1, trace.end_ns - trace.start_ns)
    t = trace
    lines = [
        f"trace {t.trace_id}  {local_time(t.start_ns)}  model {t.attr('gen_ai.request.model', '-')}  mode {t.mode}",
        f"tokens {t.input_tokens or '-'} in / {t.output_tokens} out  rounds {len(t.decode_rounds)}  "
        f"accepted {t.accepted}/{t.drafted} ({fmt(t.acceptance)})  "
        f"mean accepted length {fmt(t.mean_accepted_length)}  "
        f"latency {t.latency_ms:.1f} ms  TTFT {fmt(t.ttft_ms, '.1f')} ms  finish {t.finish_reason}",
        f"user {t.attr('enduser.id', '-')}  target passes {t.attr('specdec.target_passes', '-')} "
        f"(plain decoding: {t.attr('specdec.plain_passes', '-')})",
        "",
        f"{'':<26} {'ms':>9}  {'0 ms':<{width // 2}}{f'{total / 1e6:.1f} ms':>{width - width // 2}}",
    ]

    def row(label: str, span: SpanRecord, segments) -> str:
        return f"{label:<26.26} {span.duration_ms:>9.2f} |{_bar(width, origin, total, segments)}|"

    if t.request:
        lines.append(row("request", t.request, [(t.request.start_ns, t.request.end_ns, OTHER_CH)]))
        lines += _events_lines(t.request, " " * 4)
    for span in t.rounds:
        lines.append(row(_round_label(span), span, _round_segments(span)))
        lines += _events_lines(span, " " * 4)
        if show_all:
            for child in t.children(span):
                ch = DRAFT_CH if child.name == "draft" else VERIFY_CH if child.name == "verify" else OTHER_CH
                label = f"  └ {child.name} {child.service or ''}"
                lines.append(row(label, child, [(child.start_ns, child.end_ns, ch)]))
    legend = f"{DRAFT_CH} draft   {VERIFY_CH} verify   {OTHER_CH} request;  a/k +1: a of k drafts accepted, +1 bonus"
    lines += ["", legend]
    return "\n".join(lines)


# --- the HTML page --------------------------------------------------------------------

WIDTH, LABEL_W, LANE_H, GAP = 1100, 170, 26, 8
PLOT_W = WIDTH - LABEL_W - 20
COLORS = {
    "request": "#cbd5e1", "prefill": "#64748b", "draft": "#f59e0b", "verify": "#6366f1",
    "event": "#dc2626", "accepted": "#10b981", "bonus": "#047857", "rejected": "#e5e7eb", "plain": "#94a3b8",
    "tokens": "#0ea5e9",
}
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1140px;color:#0f172a;background:#f8fafc}
h1{font-size:20px;margin:0 0 2px} h2{font-size:15px;margin:28px 0 6px;color:#334155}
.sub{color:#64748b;font-size:12.5px;margin-bottom:14px;font-family:ui-monospace,Menlo,monospace}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:8px 14px;min-width:92px}
.card b{display:block;font-size:19px} .card span{color:#64748b;font-size:12px}
.panel{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:10px;margin-top:6px}
svg text{font-size:11px;fill:#475569} svg .lbl{font-size:12px;fill:#0f172a}
svg rect:hover,svg path:hover{stroke:#0f172a;stroke-width:1}
.legend{display:flex;gap:16px;font-size:12px;color:#475569;margin:6px 4px 0}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-2px}
table{border-collapse:collapse;width:100%;font-size:12.5px;font-variant-numeric:tabular-nums}
th,td{padding:3px 8px;text-align:right;border-bottom:1px solid #f1f5f9} th{color:#64748b;font-weight:600}
td:nth-child(2),th:nth-child(2){text-align:left} tr.ev td{color:#dc2626;text-align:left}
summary{cursor:pointer;color:#334155}
"""


def _title(head: str, attributes: dict) -> str:
    body = "\n".join(f"{k} = {v}" for k, v in attributes.items())
    return f"<title>{escape(head)}{chr(10) + escape(body) if body else ''}</title>"


def _tick_step(total_ms: float) -> float:
    raw = total_ms / 8
    base = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


class _Axis:
    def __init__(self, origin_ns: int, total_ns: int):
        self.origin, self.total = origin_ns, max(1, total_ns)

    def x(self, ns: int) -> float:
        return LABEL_W + (ns - self.origin) / self.total * PLOT_W

    def w(self, start_ns: int, end_ns: int) -> float:
        return max(0.8, (end_ns - start_ns) / self.total * PLOT_W)

    def grid(self, top: float, bottom: float) -> list[str]:
        total_ms = self.total / 1e6
        step = _tick_step(total_ms)
        out, t = [], 0.0
        while t <= total_ms + 1e-9:
            x = LABEL_W + t / total_ms * PLOT_W
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" stroke="#eef2f7"/>')
            out.append(f'<text x="{x:.1f}" y="{bottom + 13}" text-anchor="middle">{t:g} ms</text>')
            t += step
        return out


def _rect(x: float, y: float, w: float, h: float, color: str, title: str, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<rect{c} x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{h}" rx="2" fill="{color}">{title}</rect>'


def _round_mark(axis: _Axis, span: SpanRecord, y: float) -> str:
    a = span.attributes
    draft_ns = int(a.get("specdec.draft_ms", 0.0) * 1e6)
    x0, w = axis.x(span.start_ns), axis.w(span.start_ns, span.end_ns)
    head = (
        "prefill" if span.name == "prefill"
        else f"round {a.get('specdec.round')}: {a.get('specdec.accepted')}/{a.get('specdec.k')} accepted"
        + (" + bonus" if a.get("specdec.bonus") else "")
    ) + f" ({span.duration_ms:.2f} ms)"
    title = _title(head, a)
    parts = [f'<g class="round" data-round="{escape(str(a.get("specdec.round", "")))}">']
    if span.name == "prefill":
        parts.append(_rect(x0, y, w, LANE_H, COLORS["prefill"], title))
    else:
        dw = min(w, draft_ns / axis.total * PLOT_W) if draft_ns else 0.0
        if dw > 0:
            parts.append(_rect(x0, y, dw, LANE_H, COLORS["draft"], title))
        parts.append(_rect(x0 + dw, y, max(0.8, w - dw), LANE_H, COLORS["verify"], title))
    parts.append("</g>")
    return "".join(parts)


def _event_marks(axis: _Axis, span: SpanRecord, y: float) -> list[str]:
    out = []
    for e in span.events:
        x = axis.x(int(e.get("time_ns") or span.start_ns))
        where = f"{span.name} {span.attributes.get('specdec.round', '')}".strip()
        title = _title(f"{e.get('name')} (in {where})", e.get("attributes") or {})
        out.append(f'<path class="event" d="M{x:.1f},{y - 9} l5,-8 h-10 z" fill="{COLORS["event"]}">{title}</path>')
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y - 2}" y2="{y + LANE_H}" stroke="{COLORS["event"]}" '
            'stroke-dasharray="2,2"/>'
        )
    return out


def timeline_svg(trace: Trace) -> str:
    axis = _Axis(trace.start_ns, trace.end_ns - trace.start_ns)
    workers: dict[str, list[SpanRecord]] = {}
    round_ids = {r.span_id for r in trace.rounds}
    for s in trace.spans:
        if s.parent_id in round_ids:
            workers.setdefault(f"{s.name} · {s.service}"[:26] if s.service else s.name, []).append(s)
    lanes = ["request", "rounds", *sorted(workers)]
    top = 18
    height = top + len(lanes) * (LANE_H + GAP) + 24
    body = axis.grid(top - 6, height - 22)
    for i, lane in enumerate(lanes):
        y = top + i * (LANE_H + GAP)
        label_y = y + LANE_H / 2 + 4
        body.append(f'<text class="lbl" x="{LABEL_W - 8}" y="{label_y}" text-anchor="end">{escape(lane)}</text>')
        if lane == "request" and trace.request:
            r = trace.request
            body.append(_rect(axis.x(r.start_ns), y, axis.w(r.start_ns, r.end_ns), LANE_H, COLORS["request"],
                              _title(f"request ({r.duration_ms:.1f} ms)", r.attributes)))
            body += _event_marks(axis, r, y)
        elif lane == "rounds":
            body += [_round_mark(axis, s, y) for s in trace.rounds]
            for s in trace.rounds:
                body += _event_marks(axis, s, y)
        else:
            for s in workers.get(lane, []):
                color = COLORS.get(s.name, "#94a3b8")
                body.append(_rect(axis.x(s.start_ns), y + 4, axis.w(s.start_ns, s.end_ns), LANE_H - 8, color,
                                  _title(f"{s.name} ({s.duration_ms:.2f} ms)", s.attributes)))
    return f'<svg viewBox="0 0 {WIDTH} {height}" width="100%" role="img">{"".join(body)}</svg>'


def tokens_svg(trace: Trace) -> str:
    """Tokens emitted over time (same time axis as the timeline): the slope is throughput."""
    axis = _Axis(trace.start_ns, trace.end_ns - trace.start_ns)
    total = sum(r.attributes.get("specdec.emitted", 0) for r in trace.rounds) or 1
    h, top = 110, 10
    pts, count = [(axis.x(trace.start_ns), top + h)], 0
    for r in trace.rounds:
        pts.append((axis.x(r.end_ns), top + h - count / total * h))
        count += r.attributes.get("specdec.emitted", 0)
        pts.append((axis.x(r.end_ns), top + h - count / total * h))
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    body = axis.grid(top, top + h)
    body.append(f'<polyline points="{path}" fill="none" stroke="{COLORS["tokens"]}" stroke-width="2"/>')
    body.append(f'<text class="lbl" x="{LABEL_W - 8}" y="{top + 10}" text-anchor="end">{total} tokens</text>')
    body.append(f'<text class="lbl" x="{LABEL_W - 8}" y="{top + h}" text-anchor="end">0</text>')
    return f'<svg viewBox="0 0 {WIDTH} {top + h + 26}" width="100%" role="img">{"".join(body)}</svg>'


def acceptance_svg(trace: Trace) -> str:
    """One bar per decoding round: k drafted (light grey), accepted (green), the bonus token;
    a plain step (k = 0, after a fallback) is one slate token."""
    rounds = trace.decode_rounds
    if not rounds:
        return "<p>No decoding rounds.</p>"
    kmax = max(1, max(r.attributes.get("specdec.k", 0) for r in rounds) + 1)
    h, top = 120, 8
    step = PLOT_W / len(rounds)
    bw = max(1.0, step * 0.8)
    unit = h / kmax
    body = []
    for j in range(kmax + 1):
        y = top + h - j * unit
        body.append(f'<line x1="{LABEL_W}" x2="{LABEL_W + PLOT_W}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef2f7"/>')
        body.append(f'<text x="{LABEL_W - 8}" y="{y + 4:.1f}" text-anchor="end">{j}</text>')
    for i, r in enumerate(rounds):
        a = r.attributes
        k, acc, bonus = a.get("specdec.k", 0), a.get("specdec.accepted", 0), bool(a.get("specdec.bonus"))
        x = LABEL_W + i * step + (step - bw) / 2
        head = f"round {a.get('specdec.round')} ({a.get('specdec.mode')}): {acc}/{k} accepted"
        title = _title(head + (" + bonus" if bonus else ""), a)
        body.append(f'<g class="acc-bar">{_rect(x, top + h - k * unit, bw, k * unit, COLORS["rejected"], title)}')
        body.append(_rect(x, top + h - acc * unit, bw, acc * unit, COLORS["accepted"], title))
        if not k:  # a plain step: one token, nothing drafted
            body.append(_rect(x, top + h - unit, bw, unit, COLORS["plain"], title))
        if bonus:
            body.append(_rect(x, top + h - (acc + 1) * unit, bw, unit, COLORS["bonus"], title))
        body.append("</g>")
    body.append(f'<text x="{LABEL_W}" y="{top + h + 16}">round 1</text>')
    body.append(f'<text x="{LABEL_W + PLOT_W}" y="{top + h + 16}" text-anchor="end">round {len(rounds)}</text>')
    return f'<svg viewBox="0 0 {WIDTH} {top + h + 24}" width="100%" role="img">{"".join(body)}</svg>'


def _table(trace: Trace) -> str:
    columns = ["#", "span", "mode", "k", "accepted", "bonus", "emitted", "draft ms", "verify ms", "at ms"]
    head = "<tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>"
    rows = []
    for r in trace.rounds:
        a = r.attributes
        cells = [
            a.get("specdec.round", ""), r.name, a.get("specdec.mode", ""), a.get("specdec.k", ""),
            a.get("specdec.accepted", ""), "yes" if a.get("specdec.bonus") else "", a.get("specdec.emitted", ""),
            f"{a.get('specdec.draft_ms', 0):.2f}", f"{a.get('specdec.verify_ms', 0):.2f}",
            f"{(r.start_ns - trace.start_ns) / 1e6:.1f}",
        ]
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
        for e in r.events:
            attrs = ", ".join(f"{k}={v}" for k, v in (e.get("attributes") or {}).items())
            text = f"{e.get('name')} {attrs}"
            rows.append(f'<tr class="ev"><td></td><td colspan="9">&#9650; {escape(text)}</td></tr>')
    return f"<table>{head}{''.join(rows)}</table>"


def _legend(*names: str) -> str:
    items = "".join(f'<span><i style="background:{COLORS[n]}"></i>{n}</span>' for n in names)
    return f'<div class="legend">{items}</div>'


def render_html(trace: Trace) -> str:
    t = trace
    cards = [
        ("latency", f"{t.latency_ms:.1f} ms"), ("TTFT", f"{fmt(t.ttft_ms, '.1f')} ms"),
        ("tokens in / out", f"{t.input_tokens or '-'} / {t.output_tokens}"), ("tokens/s", f"{t.tokens_per_s:.1f}"),
        ("mode", t.mode), ("rounds", str(len(t.decode_rounds))), ("acceptance", fmt(t.acceptance)),
        ("mean accepted length", fmt(t.mean_accepted_length)), ("finish", t.finish_reason),
    ]
    card_html = "".join(f"<div class='card'><b>{escape(v)}</b><span>{escape(k)}</span></div>" for k, v in cards)
    request_attrs = "\n".join(f"{k} = {v}" for k, v in (t.request.attributes if t.request else {}).items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>specdec trace {escape(t.trace_id[:12])}</title>
<style>{CSS}</style></head><body>
<h1>Request {escape(t.trace_id[:12])} &middot; {escape(str(t.attr('gen_ai.request.model', '')))}</h1>
<div class="sub">trace {escape(t.trace_id)} &middot; {escape(local_time(t.start_ns))} &middot; {len(t.spans)} spans</div>
<div class="cards">{card_html}</div>
<h2>Timeline</h2>
<div class="panel">{timeline_svg(t)}{_legend('request', 'prefill', 'draft', 'verify', 'event')}</div>
<h2>Tokens emitted over time</h2>
<div class="panel">{tokens_svg(t)}</div>
<h2>Accepted drafts per round</h2>
<div class="panel">{acceptance_svg(t)}{_legend('accepted', 'bonus', 'rejected', 'plain')}</div>
<h2>Rounds</h2>
<div class="panel"><details open><summary>{len(t.rounds)} rounds (prefill included)</summary>{_table(t)}</details>
<details><summary>request attributes</summary><pre>{escape(request_attrs)}</pre></details></div>
</body></html>
"""
