"""PNG plots of a report. Optional: without matplotlib they are skipped with a logged note.

- ``{stem}_speedup.png``: speedup over plain per configuration, one bar per workload;
- ``{stem}_acceptance.png``: acceptance by draft position, one panel per workload;
- ``{stem}_concurrency.png`` (with ``--url``): aggregate and per-stream tokens/s against
  the number of concurrent streams.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(report: dict, directory: str | Path, stem: str = "bench") -> list[Path]:
    """Write the plots; return their paths ([] when matplotlib is not installed)."""
    plt = _pyplot()
    if plt is None:
        log.warning("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return []
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report["configurations"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    written = [_save(_speedup_figure(plt, rows, workloads), plt, out_dir / f"{stem}_speedup.png"),
               _save(_acceptance_figure(plt, rows, workloads), plt, out_dir / f"{stem}_acceptance.png")]
    http = report.get("http") or {}
    levels = (http.get("concurrency") or {}).get("levels") or []
    if levels:
        fig = _concurrency_figure(plt, levels, http["concurrency"]["mode"])
        written.append(_save(fig, plt, out_dir / f"{stem}_concurrency.png"))
    return written


def _speedup_figure(plt, rows: list[dict], workloads: list[str]):
    """Bars: each configuration's speedup over plain decoding, per workload."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(names) + 2), 4.5))
    width = 0.8 / max(len(workloads), 1)
    for i, w in enumerate(workloads):
        by_name = {r["name"]: r for r in rows if r["workload"] == w}
        xs = [j + i * width for j in range(len(names))]
        ys = [(by_name[n]["speedup"] or 0.0) if n in by_name else 0.0 for n in names]
        ax.bar(xs, ys, width, label=w)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=45, ha="right")
    ax.set_ylabel("speedup over plain (ours, off)")
    ax.set_title("Output tokens/s relative to plain decoding")
    ax.legend()
    fig.tight_layout()
    return fig


def _acceptance_figure(plt, rows: list[dict], workloads: list[str]):
    """Lines: acceptance at each draft position, one panel per workload, peers dashed."""
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for r in rows:
            pos = r["per_position_acceptance"]
            if r["workload"] == w and pos:
                style = "--" if r["runner"] == "hf" else "-"  # the peers dashed
                ax.plot(range(1, len(pos) + 1), pos, style, marker="o", label=r["name"])
        ax.set_title(w)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("acceptance")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        handles += [x for x, name in zip(h, lab) if name not in labels]
        labels += [name for name in lab if name not in labels]
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize="small")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def _concurrency_figure(plt, levels: list[dict], mode: str):
    """Aggregate and per-stream tokens/s against concurrent streams (HTTP)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    conc = [lv["concurrency"] for lv in levels]
    ax.plot(conc, [lv["tokens_per_s"] for lv in levels], marker="o", label="aggregate")
    ax.plot(conc, [lv["per_stream_tokens_per_s_p50"] or 0.0 for lv in levels], marker="s", label="per stream (p50)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"HTTP, mode {mode}")
    ax.legend()
    fig.tight_layout()
    return fig


def _save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
