"""From timed runs to figures: one row per (configuration, workload), targets, the table.

Definitions (per configuration and workload):

- ``tokens_per_s``: per repeat, all output tokens over all seconds of the workload's prompts;
  the median over repeats, with min and max. ``speedup``: against our plain (``off``) run by
  run: each run's tokens/s over ``off``'s on the same prompt in the same repeat (the two ran
  within a minute of each other: every configuration runs on a prompt before the next prompt
  starts), the median of those ratios, with their smallest and largest in ``speedup_range``.
  The machine's speed drifts by 10-20% over the bench's quarter of an hour, so a ratio of
  medians taken minutes apart moves as much as the speed-ups it compares; paired ratios do not.
  ``speedup_vs_hf_plain`` (transformers rows): the same against transformers' plain
  ``generate`` (``hf-plain``), what a direct run of transformers compares.
- ``transformers_settings`` (transformers rows): what its candidate generator was built with,
  by transformers' names (``inproc.candidate_settings``), and the attention it ran with; one
  dict when every run agrees, else the list of the distinct ones.
- ``acceptance_rate``: accepted / drafted over the rounds after prefill (transformers' first
  round, prefill plus the first draft's verification, counts: it drafts);
  ``mean_accepted_length``: tokens per target pass, (accepted + rounds) / rounds.
- ``per_position_acceptance[i]``: among rounds that drafted more than i tokens (a tree: whose
  depth is more than i), the share that accepted more than i (see ``ideal.per_position_acceptance``).
- ``c``: draft step / target step. The draft model's is measured directly (``costs``); a
  drafter without a model (ngram) gets its in-loop drafting time per drafted token over a
  target step; transformers' prompt lookup cannot be timed apart and counts as free (0).
  ``c_in_loop`` is what drafting cost inside our loop, per drafted token.
- ``v_k``: v(k) at the configured k; ``ideal_speedup`` from the rounds' actual draft lengths
  and the tokens they really produced (``ideal.ideal_speedup_measured``); ``efficiency`` =
  speedup / ideal_speedup.
- ``ttft_s`` / ``tpot_s``: p50 and p95 over runs; ``peak_rss_mb``: the largest RSS seen
  right after a run of the configuration (the models are shared, so rows differ little).
- HTTP rows take acceptance from the server's ``speculation`` objects and assume the server
  runs the same pair (``c`` and ``v(k)`` are this process's measurements).
- ``identical_outputs``: every greedy output token-identical to our plain output on the
  same prompt (for HTTP, which stops at EOS, a prefix of it); None when nothing was
  compared (sampling, or a server that returns no token ids).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from specdec.bench.configs import BenchConfig
from specdec.bench.costs import Costs
from specdec.bench.ideal import (
    ideal_speedup,
    ideal_speedup_measured,
    interpolate_verify_cost,
    per_position_acceptance,
)
from specdec.bench.inproc import RunResult
from specdec.stats import percentile

ROW_FIELDS = (
    "name", "runner", "mode", "k", "schedule", "workload", "runs", "output_tokens",
    "tokens_per_s", "speedup", "speedup_range", "speedup_vs_hf_plain", "acceptance_rate", "mean_accepted_length", "rounds",
    "drafted_tokens", "accepted_tokens", "per_position_acceptance", "mean_k", "c", "c_in_loop", "v_k",
    "ideal_speedup", "efficiency", "ttft_s", "tpot_s", "peak_rss_mb", "identical_outputs",
    "identical_count", "compared_count", "in_process", "policy", "transformers_settings",
)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else \
        {"median": None, "min": None, "max": None}


def _p(values: list[float | None]) -> dict:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95)}


def per_repeat_tokens_per_s(runs: list[RunResult]) -> list[float]:
    by_repeat: dict[int, list[RunResult]] = defaultdict(list)
    for r in runs:
        by_repeat[r.repeat].append(r)
    out = []
    for _, rs in sorted(by_repeat.items()):
        seconds = sum(r.seconds for r in rs)
        out.append(sum(r.output_tokens for r in rs) / seconds if seconds > 0 else 0.0)
    return out


def _acceptance(cfg: BenchConfig, runs: list[RunResult]) -> dict:
    rounds = [rd for r in runs for rd in r.rounds]
    if rounds:
        drafted = sum(rd.drafted for rd in rounds)
        accepted = sum(rd.accepted for rd in rounds)
        return {"rounds": len(rounds), "drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": (accepted + len(rounds)) / len(rounds),
                "per_position_acceptance": per_position_acceptance((rd.depth or rd.drafted, rd.accepted) for rd in rounds)}
    specs = [r.speculation for r in runs if r.speculation]
    if specs:  # what a server reported, summed over its requests
        n = sum(int(s.get("rounds", 0)) for s in specs)
        drafted = sum(int(s.get("drafted_tokens", 0)) for s in specs)
        accepted = sum(int(s.get("accepted_tokens", 0)) for s in specs)
        return {"rounds": n, "drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": (accepted + n) / n if n else None,
                "per_position_acceptance": None}
    plain = not cfg.speculative
    return {"rounds": None, "drafted_tokens": 0 if plain else None, "accepted_tokens": 0 if plain else None,
            "acceptance_rate": None, "mean_accepted_length": 1.0 if plain else None,
            "per_position_acceptance": [] if plain else None}


def _c_in_loop(rounds: list, target_step_s: float) -> float | None:
    """Drafting time per drafted token inside our loop, over a target step."""
    timed = [rd for rd in rounds if rd.draft_s is not None]
    drafted = sum(rd.drafted for rd in timed)
    return sum(rd.draft_s for rd in timed) / drafted / target_step_s if drafted else None


def _policy(runs: list[RunResult]) -> dict | None:
    """The engine policy's summaries added up over runs (adaptive configurations)."""
    summaries = [r.policy_summary for r in runs if r.policy_summary]
    if not summaries:
        return None
    total: dict = {"fallbacks": 0, "probes": 0, "mode_switches": 0, "k_histogram": {}}
    for s in summaries:
        for key in ("fallbacks", "probes", "mode_switches"):
            total[key] += int(s.get(key, 0))
        for k, n in (s.get("k_histogram") or {}).items():
            total["k_histogram"][k] = total["k_histogram"].get(k, 0) + n
    return total


def _transformers_settings(runs: list[RunResult]) -> dict | list[dict] | None:
    """The distinct settings transformers ran with over ``runs`` (one dict when they agree)."""
    distinct: list[dict] = []
    for r in runs:
        if r.hf_settings is not None and r.hf_settings not in distinct:
            distinct.append(r.hf_settings)
    if not distinct:
        return None
    return distinct[0] if len(distinct) == 1 else distinct


def _ideal(cfg: BenchConfig, rounds: list, costs: Costs, v, acceptance: float | None) -> dict:
    """c, v(k) and the ideal speedup that the measured acceptance and costs allow."""

    def c_of(mode: str | None) -> float | None:
        """c of a drafter: measured directly for a draft model, in the loop otherwise."""
        if mode in ("draft", "assisted"):
            return costs.c
        if mode == "lookup":
            return 0.0  # transformers' lookup cannot be timed apart: counted as free
        return _c_in_loop([rd for rd in rounds if rd.mode == mode], costs.target_step_s)

    if not cfg.speculative:
        return {"c": None, "v_k": 1.0, "ideal_speedup": 1.0}
    by_mode: dict[str | None, list] = defaultdict(list)
    for rd in rounds:
        if rd.drafted:
            by_mode[rd.mode].append(rd)
    main_mode = max(by_mode, key=lambda m: sum(rd.drafted for rd in by_mode[m]), default=cfg.mode)
    out = {"c": c_of(main_mode if cfg.runner != "http" else cfg.mode), "v_k": v(cfg.k) if cfg.k is not None else None}
    if rounds:  # per round: the acceptance and c of the drafter that drafted it
        a_c = {m: (sum(rd.accepted for rd in rs) / sum(rd.drafted for rd in rs), c_of(m)) for m, rs in by_mode.items()}
        if any(c is None for _, c in a_c.values()):
            out["ideal_speedup"] = None
        else:
            per_round = ((rd.accepted + 1, rd.drafted, a_c[rd.mode][1]) if rd.drafted else (1, 0, 0.0) for rd in rounds)
            out["ideal_speedup"] = ideal_speedup_measured(per_round, v)
    elif cfg.k is not None and acceptance is not None and out["c"] is not None:
        out["ideal_speedup"] = ideal_speedup(acceptance, cfg.k, out["c"], v(cfg.k))
    else:
        out["ideal_speedup"] = None
    return out


def paired_ratios(runs: list[RunResult], baseline: list[RunResult]) -> list[float]:
    """Each run's tokens/s over the baseline run on the same prompt in the same repeat (runs
    without such a partner are left out)."""
    partner = {(r.prompt, r.repeat): r.tokens_per_s for r in baseline}
    return [r.tokens_per_s / partner[(r.prompt, r.repeat)] for r in runs if partner.get((r.prompt, r.repeat))]


def summarize(
    cfg: BenchConfig, workload: str, runs: list[RunResult], *, costs: Costs, baseline: list[RunResult],
    references: dict[str, list[int]], greedy_prompts: set[str], hf_plain: list[RunResult] = (),
) -> dict:
    """One row of figures for ``cfg`` on ``workload`` (see the module docstring); ``baseline``
    and ``hf_plain``: the workload's runs of ``off`` and ``hf-plain``."""
    tps = _spread(per_repeat_tokens_per_s(runs))
    row: dict = {"name": cfg.name, "runner": cfg.runner, "mode": cfg.mode, "k": cfg.k,
                 "schedule": cfg.schedule, "workload": workload, "in_process": cfg.in_process, "runs": len(runs),
                 "output_tokens": sum(r.output_tokens for r in runs), "tokens_per_s": tps}
    paired = _spread(paired_ratios(runs, baseline))
    row["speedup"] = paired["median"]
    row["speedup_range"] = [paired["min"], paired["max"]] if paired["median"] is not None else None
    row["speedup_vs_hf_plain"] = (
        _spread(paired_ratios(runs, list(hf_plain)))["median"] if cfg.runner == "hf" else None
    )
    row.update(_acceptance(cfg, runs))
    rounds = [rd for r in runs for rd in r.rounds]
    row["mean_k"] = sum(rd.drafted for rd in rounds) / len(rounds) if rounds else None
    v = interpolate_verify_cost(costs.v)
    row["c_in_loop"] = _c_in_loop(rounds, costs.target_step_s)
    row.update(_ideal(cfg, rounds, costs, v, row["acceptance_rate"]))
    row["efficiency"] = (
        row["speedup"] / row["ideal_speedup"] if row["speedup"] is not None and row["ideal_speedup"] else None
    )
    row["ttft_s"] = _p([r.ttft_s for r in runs])
    row["tpot_s"] = _p([r.tpot_s for r in runs])
    rss = [r.rss_mb for r in runs if r.rss_mb is not None]
    row["peak_rss_mb"] = max(rss) if rss else None
    compared = [r for r in runs if r.prompt in greedy_prompts and r.output_ids is not None and r.prompt in references]
    # A server stops at EOS where in-process runs ignore it: its output must be a prefix.
    same = sum(bool(r.output_ids) and r.output_ids == references[r.prompt][: len(r.output_ids)] for r in compared)
    row["identical_count"], row["compared_count"] = same, len(compared)
    row["identical_outputs"] = (same == len(compared)) if compared else None
    row["policy"] = _policy(runs)
    row["transformers_settings"] = _transformers_settings(runs) if cfg.runner == "hf" else None
    assert set(row) == set(ROW_FIELDS), set(row) ^ set(ROW_FIELDS)
    return row


# --------------------------------------------------------------------------- targets


def _best(rows: list[dict], pred) -> dict | None:
    cands = [r for r in rows if pred(r) and r["tokens_per_s"]["median"] is not None]
    return max(cands, key=lambda r: r["tokens_per_s"]["median"]) if cands else None


PLAIN_TPOT_OVER_STEP = 1.1  # plain decoding's time per output token, at most this many model steps


def targets(rows: list[dict], costs: Costs | None = None, contexts: dict[str, int] | None = None) -> list[dict]:
    """The goals the benchmark reports against (met / not met; never asserted). ``contexts``:
    each workload's decode context, where its plain step was timed (``Costs.steps``)."""
    out = []
    workloads = sorted({r["workload"] for r in rows}, key=[r["workload"] for r in rows].index)
    for w in workloads if costs is not None else ():
        # What the loop adds to a lone stream's model step (its step timed in the same numerics,
        # at the workload's decode context: a longer prompt makes every step attend to more).
        plain = next((r for r in rows if r["workload"] == w and r["runner"] == "ours" and r["mode"] == "off"), None)
        if plain and plain["tpot_s"]["p50"] is not None:
            # The step timed beside the plain runs where there is one (the same minutes: the
            # machine drifts), else the one timed with the costs.
            at, step = costs.step_at((contexts or {}).get(w))
            when = " beside the plain runs" if costs.beside.get(at) else ""
            ratio = plain["tpot_s"]["p50"] / step
            out.append({"target": f"plain TPOT <= {PLAIN_TPOT_OVER_STEP}x target step", "scope": w, "value": ratio,
                        "threshold": PLAIN_TPOT_OVER_STEP, "met": ratio <= PLAIN_TPOT_OVER_STEP,
                        "detail": f"TPOT p50 {plain['tpot_s']['p50'] * 1e3:.1f} ms, step {step * 1e3:.1f} ms at "
                                  f"{at} tokens{when} ({costs.numerics} numerics; {costs.target_step_s * 1e3:.1f} ms "
                                  f"at {costs.context_tokens} with the costs)"})
    for ours_mode, peer_mode, label in (("draft", "assisted", "draft >= transformers assisted"),
                                        ("ngram", "lookup", "ngram >= transformers prompt lookup")):
        for w in workloads:
            wr = [r for r in rows if r["workload"] == w]
            ours = _best(wr, lambda r: r["runner"] == "ours" and r["mode"] == ours_mode)
            peer = _best(wr, lambda r: r["runner"] == "hf" and r["mode"] == peer_mode)
            if ours and peer:
                a, b = ours["tokens_per_s"]["median"], peer["tokens_per_s"]["median"]
                out.append({"target": label, "scope": w, "value": a / b, "threshold": 1.0, "met": a >= b,
                            "detail": f"{ours['name']} {a:.1f} vs {peer['name']} {b:.1f} tok/s"})
    by_config: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_config[r["name"]].append(r)
    for name, rs in by_config.items():
        first = rs[0]
        if first["runner"] == "ours" and first["mode"] != "off":
            effs = [(r["efficiency"], r["workload"]) for r in rs if r["efficiency"] is not None]
            if effs:
                worst, w = min(effs)
                out.append({"target": "efficiency >= 0.85", "scope": name, "value": worst, "threshold": 0.85,
                            "met": worst >= 0.85, "detail": f"worst workload: {w}"})
        if first["mode"] == "auto" and first["runner"] == "ours":
            sp = [(r["speedup"], r["workload"]) for r in rs if r["speedup"] is not None]
            if sp:
                worst, w = min(sp)
                out.append({"target": "auto >= 0.95x plain", "scope": name, "value": worst, "threshold": 0.95,
                            "met": worst >= 0.95, "detail": f"worst workload: {w}"})
        if first["runner"] == "http":
            ratios = []
            for r in rs:
                twin = next((t for t in rows if t["workload"] == r["workload"] and t["runner"] == "ours"
                             and t["name"] == r.get("in_process")), None)
                if twin and twin["tokens_per_s"]["median"] and r["tokens_per_s"]["median"] is not None:
                    ratios.append((r["tokens_per_s"]["median"] / twin["tokens_per_s"]["median"], r["workload"]))
            if ratios:
                worst, w = min(ratios)
                out.append({"target": "HTTP single stream >= 0.85x in-process", "scope": name, "value": worst,
                            "threshold": 0.85, "met": worst >= 0.85, "detail": f"worst workload: {w}"})
    return out + _speculation_targets(rows, workloads, costs)


AUTO_OVER_PEER = 1.2  # auto over transformers' best assisted / prompt-lookup row, every workload
# auto over plain decoding, where verifying drafts is nearly free (v(4) <= FREE_VERIFY)
AUTO_SPEEDUP = {"chat": 1.6, "sampling": 1.4, "code": 2.5, "grounded": 2.5}
FREE_VERIFY = 1.2
TREE_OVER_CHAIN = 1.3  # the best tree mode's mean accepted length over its chain's, same k, on chat


def _speculation_targets(rows: list[dict], workloads: list[str], costs: Costs | None) -> list[dict]:
    """What speculation must deliver: ``auto`` against transformers' best speculative row and
    against plain decoding (the latter only on a machine where a 5-token pass costs at most
    ``FREE_VERIFY`` steps: elsewhere verifying drafts is not free and the goal does not apply),
    and trees against chains: a tree of depth k earns its extra nodes only by keeping more of
    the target's tokens a round than the chain of k drafts its drafter would have proposed."""
    out = []
    v4 = costs.v.get(4) if costs is not None else None
    for w in workloads:
        wr = [r for r in rows if r["workload"] == w]
        auto = _best(wr, lambda r: r["runner"] == "ours" and r["mode"] == "auto")
        if auto is None:
            continue
        a = auto["tokens_per_s"]["median"]
        peer = _best(wr, lambda r: r["runner"] == "hf" and r["mode"] in ("assisted", "lookup"))
        if peer:
            b = peer["tokens_per_s"]["median"]
            out.append({"target": f"auto >= {AUTO_OVER_PEER}x transformers' best", "scope": w, "value": a / b,
                        "threshold": AUTO_OVER_PEER, "met": a >= AUTO_OVER_PEER * b,
                        "detail": f"auto {a:.1f} vs {peer['name']} {b:.1f} tok/s"})
        if w in AUTO_SPEEDUP and v4 is not None and v4 <= FREE_VERIFY and auto["speedup"] is not None:
            goal = AUTO_SPEEDUP[w]
            out.append({"target": f"auto >= {goal}x off where v(4) <= {FREE_VERIFY}", "scope": w,
                        "value": auto["speedup"], "threshold": goal, "met": auto["speedup"] >= goal,
                        "detail": f"v(4) = {v4:.2f}; auto {a:.1f} tok/s"})
    chat = [r for r in rows if r["workload"] == "chat" and r["runner"] == "ours" and r.get("schedule") == "fixed"
            and r.get("mean_accepted_length") is not None]
    pairs = []
    for tree in (r for r in chat if r["mode"].endswith("_tree")):
        chain = next((r for r in chat if r["mode"] == tree["mode"].removesuffix("_tree") and r["k"] == tree["k"]), None)
        if chain:
            pairs.append((tree, chain))
    if pairs:
        tree, chain = max(pairs, key=lambda p: p[0]["mean_accepted_length"])
        ratio = tree["mean_accepted_length"] / chain["mean_accepted_length"]
        out.append({"target": f"best tree length >= {TREE_OVER_CHAIN}x its chain's", "scope": "chat",
                    "value": ratio, "threshold": TREE_OVER_CHAIN, "met": ratio >= TREE_OVER_CHAIN,
                    "detail": f"{tree['name']} {tree['mean_accepted_length']:.2f} vs {chain['name']} "
                              f"{chain['mean_accepted_length']:.2f} tokens a round"})
    return out


# --------------------------------------------------------------------------- terminal


def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, fmt)


def _ms(x) -> str:
    return _f(x * 1000 if x is not None else None, ".1f")


HEADER = ("config", "tok/s", "min-max", "speedup", "vs hf", "accept", "len", "c", "v(k)", "ideal", "eff",
          "TTFT p50", "TPOT p50", "p95", "RSS MB", "same")


def format_table(rows: list[dict]) -> str:
    """Rows grouped by workload, one line per configuration."""
    lines = []
    widths = (24, 8, 13, 7, 5, 6, 5, 5, 5, 5, 5, 8, 8, 6, 7, 5)
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for w in workloads:
        lines.append(f"== {w} ==")
        lines.append(fmt.format(*HEADER))
        for r in (r for r in rows if r["workload"] == w):
            t = r["tokens_per_s"]
            same = "-" if r["identical_outputs"] is None else f"{r['identical_count']}/{r['compared_count']}"
            lines.append(fmt.format(
                r["name"], _f(t["median"], ".1f"), f"{_f(t['min'], '.1f')}-{_f(t['max'], '.1f')}",
                _f(r["speedup"]), _f(r["speedup_vs_hf_plain"]), _f(r["acceptance_rate"]),
                _f(r["mean_accepted_length"]), _f(r["c"]), _f(r["v_k"]), _f(r["ideal_speedup"]),
                _f(r["efficiency"]), _ms(r["ttft_s"]["p50"]), _ms(r["tpot_s"]["p50"]), _ms(r["tpot_s"]["p95"]),
                _f(r["peak_rss_mb"], ".0f"), same,
            ))
        lines.append("")
    legend = format_transformers_settings(rows)
    if legend:
        lines += [legend, ""]
    return "\n".join(lines)


def _settings_text(settings: dict) -> str:
    shown = {k: v for k, v in settings.items() if k not in ("candidate_generator", "eos_token_id")}
    text = " ".join(f"{k}={v}" for k, v in shown.items())
    generator = settings.get("candidate_generator")
    return f"{generator}: {text}" if generator else text


def format_transformers_settings(rows: list[dict]) -> str:
    """One line per transformers configuration: the settings its runs were built with."""
    lines, seen = [], set()
    for r in rows:
        settings = r.get("transformers_settings")
        if r["runner"] != "hf" or settings is None or r["name"] in seen:
            continue
        seen.add(r["name"])
        many = settings if isinstance(settings, list) else [settings]
        lines.append(f"  {r['name']:<24} " + " | ".join(_settings_text(s) for s in many))
    return "\n".join(["== transformers settings (as transformers applied them) ==", *lines]) if lines else ""


def format_targets(items: list[dict]) -> str:
    lines = ["== targets =="]
    for t in items:
        mark = "met" if t["met"] else "NOT MET"
        lines.append(f"  [{mark:>7}] {t['target']:<40} {t['scope']:<22} {t['value']:.2f} "
                     f"(threshold {t['threshold']:.2f}; {t['detail']})")
    if not items:
        lines.append("  (no target could be evaluated with these configurations)")
    return "\n".join(lines)


def format_concurrency(rows: list[dict]) -> str:
    lines = ["== HTTP concurrency ==",
             f"  {'conc':>4}  {'reqs':>4}  {'err':>3}  {'tok/s':>8}  {'stream tok/s':>12}  {'TTFT p50':>8}  "
             f"{'TTFT p95':>8}  {'TPOT p50':>8}  {'TPOT p95':>8}"]
    for r in rows:
        lines.append(
            f"  {r['concurrency']:>4}  {r['requests']:>4}  {r['errors']:>3}  {_f(r['tokens_per_s'], '.1f'):>8}  "
            f"{_f(r['per_stream_tokens_per_s_p50'], '.1f'):>12}  {_ms(r['ttft_s']['p50']):>8}  "
            f"{_ms(r['ttft_s']['p95']):>8}  {_ms(r['tpot_s']['p50']):>8}  {_ms(r['tpot_s']['p95']):>8}"
        )
    return "\n".join(lines)
