"""The demo's trained weights, shipped inside the package, and the fast first run they allow.

``specdec/demo/weights/`` holds what ``specdec demo-models --train`` trained (16-bit
safetensors): the draft's own parameters (its layers and reduced head; the embeddings are the
target's and are written from the converted target), the EAGLE head, the Medusa heads and the
early-exit adapter (with the exit summary; ``install_exit`` adds it to an older cache), their markers, the
training build's ``metrics.json``, and ``manifest.json`` with the SHA-256 of every file and
the fingerprint of the target they were trained on.

``assemble(out)``: convert the target from the GGUF (phase 1 of the build), check every hash,
and write ``draft/``, ``eagle/``, ``medusa/`` and ``exit/`` from the shipped files: about a minute instead of the
training build's hour. ``export(root)`` writes the weights directory from a training build.
``refresh(root)``: a cache assembled from an older specdec's weights gets the installed ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from specdec.models.files import (DRAFT_EMBEDDINGS, DRAFT_MARKER, DRAFT_WEIGHTS, EAGLE_MARKER, EAGLE_WEIGHTS,
                                  EXIT_MARKER, EXIT_SUMMARY, EXIT_WEIGHTS, MEDUSA_MARKER, MEDUSA_WEIGHTS)

WEIGHTS_DIR = Path(__file__).parent / "weights"
MANIFEST = "manifest.json"
# shipped name -> (demo subdirectory, name there)
FILES = {
    "draft.safetensors": ("draft", DRAFT_WEIGHTS),
    "draft.json": ("draft", DRAFT_MARKER),
    "eagle.safetensors": ("eagle", EAGLE_WEIGHTS),
    "eagle.json": ("eagle", EAGLE_MARKER),
    "medusa.safetensors": ("medusa", MEDUSA_WEIGHTS),
    "medusa.json": ("medusa", MEDUSA_MARKER),
    "metrics.json": (".", "metrics.json"),
}
# The early-exit adapter, shipped when the training build made one (its layer is in exit.json):
# shipped name -> name in the demo's exit/layer{L}/ (EXIT_SUMMARY: in exit/ itself).
EXIT_FILES = {"exit.safetensors": EXIT_WEIGHTS, "exit.json": EXIT_MARKER, "exit_summary.json": EXIT_SUMMARY}


def _exit_layer(summary: Path) -> int | None:
    """The layer of the adapter an exit summary names (None: no adapter there)."""
    try:
        return int(json.loads(summary.read_text())["best_layer"])
    except (OSError, ValueError, KeyError):
        return None


def shipped_files(weights: Path = WEIGHTS_DIR) -> dict[str, tuple[str, str]]:
    """Every shipped name -> (demo subdirectory, name there): ``FILES``, plus the exit adapter's
    when it is shipped."""
    layer = _exit_layer(weights / "exit_summary.json")
    if layer is None:
        return dict(FILES)
    return {**FILES, **{name: ("exit" if there == EXIT_SUMMARY else f"exit/layer{layer}", there)
                        for name, there in EXIT_FILES.items()}}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def available(weights: Path = WEIGHTS_DIR) -> bool:
    return (weights / MANIFEST).is_file() and all((weights / name).is_file() for name in shipped_files(weights))


def verify(weights: Path = WEIGHTS_DIR) -> dict:
    """The manifest, after checking every shipped file against its SHA-256 (ValueError if not)."""
    manifest = json.loads((weights / MANIFEST).read_text())
    for name in {*shipped_files(weights), *manifest["sha256"]}:
        want, got = manifest["sha256"].get(name), sha256(weights / name)
        if want != got:
            raise ValueError(f"{weights / name}: SHA-256 {got} does not match the manifest's {want}; "
                             "reinstall specdec or rebuild with `specdec demo-models --train`")
    return manifest


def export(root: Path, weights: Path = WEIGHTS_DIR) -> dict:
    """Copy a training build's draft / EAGLE head / Medusa heads / metrics from ``root`` into ``weights`` and
    write the manifest (hashes, the target's fingerprint)."""
    weights.mkdir(parents=True, exist_ok=True)
    files = dict(FILES)
    layer = _exit_layer(root / "exit" / EXIT_SUMMARY)
    if layer is not None:  # the adapter, its marker and the exit summary; weights in 16 bits
        files |= {name: ("exit" if there == EXIT_SUMMARY else f"exit/layer{layer}", there)
                  for name, there in EXIT_FILES.items()}
    for name, (sub, there) in files.items():
        if name == "exit.safetensors":
            _save_16bit(root / sub / there, weights / name)
        else:
            shutil.copyfile(root / sub / there, weights / name)
    metrics = json.loads((root / "metrics.json").read_text())
    manifest = {"sha256": {name: sha256(weights / name) for name in files},
                "target_fingerprint": metrics["target"]["fingerprint"],
                "bytes": sum((weights / name).stat().st_size for name in files)}
    (weights / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def install_exit(root: Path, weights: Path = WEIGHTS_DIR) -> bool:
    """Write the shipped early-exit adapter into the demo directory ``root`` (exit/layer{L} and
    the exit summary, hashes checked); False when none ships."""
    placed = {name: where for name, where in shipped_files(weights).items() if where[0].startswith("exit")}
    if not placed:
        return False
    verify(weights)
    for name, (sub, there) in placed.items():
        (root / sub).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights / name, root / sub / there)
    return True


def refresh(root: Path, weights: Path = WEIGHTS_DIR) -> list[str]:
    """Bring a demo cache assembled from shipped weights up to the installed ones; returns the
    shipped names it copied again.

    A file whose copy in ``root`` differs from the installed one (an upgrade shipped a new head)
    is copied again, hashes checked, each by an atomic rename, weights before their markers;
    ``metrics.json`` becomes the shipped one with the cache's ``assembled`` record. A file the
    cache does not hold is left to whoever installs it (the exit adapter: ``install_exit``). A
    cache built by ``--train`` has no ``assembled`` record: it is the user's own, left alone.
    The target is not converted again (the shipped weights name its fingerprint, which does
    not change with them).
    """
    try:
        metrics = json.loads((root / "metrics.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(metrics, dict) or "assembled" not in metrics or not available(weights):
        return []
    placed = shipped_files(weights)
    manifest = json.loads((weights / MANIFEST).read_text())
    stale = [name for name, (sub, there) in placed.items() if name != "metrics.json"
             and (root / sub / there).is_file() and sha256(root / sub / there) != manifest["sha256"].get(name)]
    shipped_metrics = json.loads((weights / "metrics.json").read_text())
    if {k: v for k, v in metrics.items() if k != "assembled"} != shipped_metrics:
        stale.append("metrics.json")
    if not stale:
        return []
    verify(weights)
    for name in sorted(stale, key=lambda n: (n == "metrics.json", n.endswith(".json"))):  # markers last
        sub, there = placed[name]
        dst = root / sub / there
        tmp = dst.with_name(dst.name + f".refresh-{os.getpid()}")
        if name == "metrics.json":
            tmp.write_text(json.dumps({**shipped_metrics, "assembled": metrics["assembled"]}, indent=2))
        else:
            shutil.copyfile(weights / name, tmp)
        os.replace(tmp, dst)
    return stale


def _save_16bit(src: Path, dst: Path) -> None:
    """A safetensors file with its float tensors in bfloat16 (ids stay as they are)."""
    import torch
    from safetensors.torch import load_file, save_file

    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(src)).items()}
    save_file(state, str(dst))


def assemble(out: Path, weights: Path = WEIGHTS_DIR, target: str | None = None) -> dict:
    """Build ``out`` (tokenizer/, target/, draft/, eagle/, medusa/, metrics.json) from the GGUF (or the
    Hugging Face directory ``target``) and the shipped weights; returns the metrics (the
    training build's, plus ``"assembled"``)."""
    from safetensors.torch import save_file

    from .target import convert_target, copy_target, target_fingerprint

    t0 = time.time()
    manifest = verify(weights)
    _say("converting the target; the draft, the EAGLE head and the Medusa heads are shipped (hashes checked)")
    for sub in ("target", "tokenizer"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    conv = (copy_target(target, out / "target", out / "tokenizer") if target
            else convert_target(out / "target", out / "tokenizer"))
    target, tok = conv["model"], conv["tokenizer"]
    fingerprint = target_fingerprint(target)
    if fingerprint != manifest["target_fingerprint"]:  # still exact, but maybe a weaker draft
        _say("warning: the converted target differs from the one the shipped weights were trained on "
                 "(another transformers/gguf version?); speculation stays exact, acceptance may drop")
    for name, (sub, there) in shipped_files(weights).items():
        (out / sub).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights / name, out / sub / there)
    import torch

    # what save_draft writes: the target's embeddings in bf16 (the draft's frozen input layer)
    embeddings = target.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
    save_file({"model.embed_tokens.weight": embeddings}, str(out / "draft" / DRAFT_EMBEDDINGS))
    tok.save_pretrained(str(out / "draft"))
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["assembled"] = {"seconds": round(time.time() - t0, 1), "convert_seconds": conv["seconds"],
                            "target_fingerprint_matches": fingerprint == manifest["target_fingerprint"]}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _say(msg: str) -> None:
    print(f"[specdec demo] {msg}", file=sys.stderr)
