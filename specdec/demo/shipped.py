"""The demo's trained weights, shipped inside the package, and the fast first run they allow.

``specdec/demo/weights/`` holds what ``specdec demo-models --train`` trained (16-bit
safetensors): the draft's own parameters (its layers and reduced head; the embeddings are the
target's and are written from the converted target), the EAGLE head and the Medusa heads, their markers, the
training build's ``metrics.json``, and ``manifest.json`` with the SHA-256 of every file and
the fingerprint of the target they were trained on.

``assemble(out)``: convert the target from the GGUF (phase 1 of the build), check every hash,
and write ``draft/``, ``eagle/`` and ``medusa/`` from the shipped files: about a minute instead of the
training build's hour. ``export(root)`` writes the weights directory from a training build.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from specdec.models.files import (DRAFT_EMBEDDINGS, DRAFT_MARKER, DRAFT_WEIGHTS, EAGLE_MARKER, EAGLE_WEIGHTS,
                                  MEDUSA_MARKER, MEDUSA_WEIGHTS)

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


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def available(weights: Path = WEIGHTS_DIR) -> bool:
    return (weights / MANIFEST).is_file() and all((weights / name).is_file() for name in FILES)


def verify(weights: Path = WEIGHTS_DIR) -> dict:
    """The manifest, after checking every shipped file against its SHA-256 (ValueError if not)."""
    manifest = json.loads((weights / MANIFEST).read_text())
    for name in FILES:
        want, got = manifest["sha256"].get(name), sha256(weights / name)
        if want != got:
            raise ValueError(f"{weights / name}: SHA-256 {got} does not match the manifest's {want}; "
                             "reinstall specdec or rebuild with `specdec demo-models --train`")
    return manifest


def export(root: Path, weights: Path = WEIGHTS_DIR) -> dict:
    """Copy a training build's draft / EAGLE head / Medusa heads / metrics from ``root`` into ``weights`` and
    write the manifest (hashes, the target's fingerprint)."""
    weights.mkdir(parents=True, exist_ok=True)
    for name, (sub, there) in FILES.items():
        shutil.copyfile(root / sub / there, weights / name)
    metrics = json.loads((root / "metrics.json").read_text())
    manifest = {"sha256": {name: sha256(weights / name) for name in FILES},
                "target_fingerprint": metrics["target"]["fingerprint"],
                "bytes": sum((weights / name).stat().st_size for name in FILES)}
    (weights / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


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
    for name, (sub, there) in FILES.items():
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
