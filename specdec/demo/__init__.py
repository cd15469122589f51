"""The offline demo models: SmolLM2-135M-Instruct (target), a distilled 2-layer draft and an
EAGLE head and Medusa heads, all trained on the target by this project.

This package builds and trains the demo models; their definitions and loaders are
:mod:`specdec.models` (which never imports this package).

``build_demo_models()`` writes ``$SPECDEC_HOME/demo/{tokenizer,target,draft,eagle,medusa}`` and
``metrics.json`` (``SPECDEC_HOME`` defaults to ``~/.cache/specdec``). By default it converts the
target from the GGUF and takes the draft and the heads from the weights shipped in the package
(hashes checked; :mod:`specdec.demo.shipped`); ``train=True`` rebuilds everything from scratch
(:mod:`specdec.demo.build`). Either runs in a temp directory next to the final one, renamed
into place at the end, so an interrupted build is never mistaken for a finished one. A second
call finds the complete cache and returns at once (a cache assembled from an older specdec's
shipped weights gets the installed ones first: ``shipped.refresh``).

Rebuild and retrain from scratch (about an hour on 2 cores)::

    specdec demo-models --train --force
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

# Standard library only, so that a cache hit loads no torch; the builders (``build``,
# ``exit_adapter``) are imported when a build runs.
from specdec.models.files import DRAFT_FILES, DRAFT_MARKER, EAGLE_FILES, EXIT_FILES, EXIT_SUMMARY, MEDUSA_FILES
from specdec.paths import specdec_home

from .config import BuildConfig

__all__ = ["build_demo_models", "demo_exit_adapter", "demo_home", "demo_paths", "is_demo_complete"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_TARGET_FILES = ("config.json", "model.safetensors") + _TOKENIZER_FILES


def demo_home(home: Path | str | None = None) -> Path:
    return (specdec_home() if home is None else Path(home).expanduser()) / "demo"


def demo_paths(home: Path | str | None = None) -> dict:
    """``{"tokenizer": ..., "target": ..., "draft": ..., "eagle": ..., "medusa": ...}`` (plus ``"root"``,
    ``"metrics"`` and ``"exit"``)."""
    root = demo_home(home)
    return {"tokenizer": root / "tokenizer", "target": root / "target", "draft": root / "draft",
            "eagle": root / "eagle", "medusa": root / "medusa", "root": root, "metrics": root / "metrics.json", "exit": root / "exit"}


def demo_exit_adapter(home: Path | str | None = None) -> Path | None:
    """The demo's early-exit adapter (the shallowest exit layer built), or None. A finished cache
    without one gets the shipped adapter (hashes checked; a copy, no build)."""
    from . import shipped

    root = demo_home(home)
    if _complete(root) and not _exit_complete(root):
        shipped.install_exit(root)
    built = sorted(demo_paths(home)["exit"].glob("layer*"), key=lambda p: int(p.name[5:]))
    return built[0] if built else None


def _complete(root: Path) -> bool:
    p = {k: root / k for k in ("tokenizer", "target", "draft")}
    files = [root / "metrics.json"]
    files += [p["tokenizer"] / f for f in _TOKENIZER_FILES]
    files += [p["target"] / f for f in _TARGET_FILES]
    files += [p["draft"] / f for f in _TOKENIZER_FILES + DRAFT_FILES]
    files += [root / "eagle" / f for f in EAGLE_FILES]
    files += [root / "medusa" / f for f in MEDUSA_FILES]
    if not all(f.is_file() and f.stat().st_size > 0 for f in files):
        return False
    try:
        json.loads((root / "metrics.json").read_text())
        json.loads((p["draft"] / DRAFT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return True


def _remove_stale_builds(parent: Path) -> None:
    """Delete temp dirs of killed builds (``.demo.build-<pid>-<t>`` whose pid is gone)."""
    for d in parent.glob(".demo.build-*"):
        try:
            pid = int(d.name.split("-")[1])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


def is_demo_complete(home: Path | str | None = None) -> bool:
    return _complete(demo_home(home))


def _exit_complete(root: Path) -> bool:
    """Whether ``root/exit`` holds a finished build (the summary and every adapter it names). The
    early-exit adapters have their own check, so a finished target/draft cache gets them added
    without a rebuild."""
    try:
        layers = json.loads((root / "exit" / EXIT_SUMMARY).read_text()).get("layers", {})
    except (OSError, ValueError):
        return False
    return bool(layers) and all((root / "exit" / f"layer{L}" / name).is_file()
                                for L in layers for name in EXIT_FILES)


def _exit_buildable(root: Path) -> bool:
    try:
        model_type = json.loads((root / "target" / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return model_type in ("llama", "gpt2")


def _ensure_exit(root: Path) -> None:
    """Phase 7: add the early-exit adapters to a finished cache that lacks them (the shipped
    adapter when there is one, else a build)."""
    from . import shipped

    if _exit_complete(root) or (shipped.install_exit(root) and _exit_complete(root)):
        return
    if not _exit_buildable(root):
        print(f"[specdec demo] no early-exit adapters: {root / 'target'} is not a Llama/GPT-2 model",
              file=sys.stderr)
        return
    from .exit_adapter import add_exit_adapters  # loads torch: only when the adapters are built

    add_exit_adapters(root)


def build_demo_models(home: Path | str | None = None, *, force: bool = False, train: bool = False,
                      budget_s: float | None = None, seed: int = 0, config=None, early_exit: bool = False) -> Path:
    """Build (or find cached) demo models; returns the ``demo`` directory.

    Without ``train``: convert the target and add the shipped draft, EAGLE and Medusa heads (about a
    minute). ``train`` (or no shipped weights): the whole training build. ``budget_s`` caps its
    training phase by wall-clock (the default fixed step counts are deterministic; a budget
    makes the result depend on machine speed). ``config`` (a
    :class:`specdec.demo.config.BuildConfig`) overrides its sizes. ``early_exit``: also build
    the early-exit adapters (``exit/``, a few minutes; added to a finished cache without a rebuild).
    """
    from . import shipped

    root = demo_home(home)
    if not force and _complete(root):
        print(f"[specdec demo] using cached demo models in {root}", file=sys.stderr)
        refreshed = shipped.refresh(root)  # an upgrade's new heads replace an assembled cache's old ones
        if refreshed:
            print(f"[specdec demo] refreshed from this specdec's shipped weights: {', '.join(refreshed)}",
                  file=sys.stderr)
        if early_exit:
            _ensure_exit(root)
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root.parent)
    tmp = root.parent / f".demo.build-{os.getpid()}-{int(time.time())}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if train or not shipped.available():
            from .build import build  # the builder loads torch: only when a build runs

            metrics = build(tmp, config or BuildConfig(seed=seed, budget_s=budget_s))
        else:
            metrics = shipped.assemble(tmp)
        _swap_in(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if early_exit:
        _ensure_exit(root)
    _report(root, metrics)
    return root


def _swap_in(tmp: Path, root: Path) -> None:
    if root.exists():
        old = root.parent / f".demo.old-{os.getpid()}-{int(time.time())}"
        root.rename(old)
        tmp.rename(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(root)


def _report(root: Path, metrics: dict) -> None:
    d, e = metrics["draft"], metrics["eagle"]
    how = (f"assembled in {metrics['assembled']['seconds']:.0f} s" if "assembled" in metrics
           else f"built in {metrics['build_seconds']:.0f} s")
    print(f"[specdec demo] {how} -> {root}\n"
          f"  draft agreement: code {d['agreement_code_heldout']:.3f}, chat {d['agreement_chat_heldout']:.3f}; "
          f"c = {metrics['cost']['c']:.3f}\n"
          f"  EAGLE agreement: code {e['agreement_code_heldout']:.3f}, chat {e['agreement_chat_heldout']:.3f}; "
          f"c = {e['cost']['c']:.3f}", file=sys.stderr)
    if "medusa" in metrics:
        m = metrics["medusa"]
        print("  Medusa top-1 agreement by head: " + "; ".join(
            f"{name} " + "/".join(f"{a:.2f}" for a in m[f"agreement_{name}_heldout"]["top1"]) for name in ("code", "chat")),
            file=sys.stderr)
