"""The training half of ``scripts/eagle3.py``: train / evaluate an EAGLE head on the data that
``eagle3.py data`` cached (the library's functions: specdec.demo.eagle)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from eagle3 import DEMO, load_target
from specdec.demo.eagle import EagleTrainConfig, eagle_agreement, init_eagle_head, train_eagle
from specdec.models.eagle import load_eagle_head, save_eagle_head

log = logging.getLogger("eagle3")


def held_out(work: Path) -> dict:
    return torch.load(work / "heldout.pt")


def agreements(head, held: dict, depths=(1, 2, 3)) -> dict:
    return {f"depth{d}_{name}": round(eagle_agreement(head, held[name], d), 4) for name in ("chat", "code")
            for d in depths}


def evaluate(args, cfg) -> dict:
    target, _ = load_target()
    head = load_eagle_head(args.dir or DEMO / "eagle", target, torch.float32)
    out = agreements(head, held_out(args.work))
    log.info("held-out agreement of %s: %s", args.dir, out)
    print(json.dumps(out))  # the script's output (``ship --prev-json`` reads it)
    return out


def train(args, cfg) -> dict:
    target, _ = load_target()
    work = args.work
    diverse = torch.load(work / "diverse" / "diverse.pt")
    code = torch.load(work / "code.pt")
    examples = diverse["examples"] + code
    shipped = load_eagle_head(DEMO / "eagle", target, torch.float32)
    tcfg = EagleTrainConfig(seed=cfg.seed, steps=args.steps, batch_tokens=cfg.batch_tokens, lr=args.lr, warmup=10,
                            intermediate_size=cfg.eagle_intermediate_size, ttt_steps=args.ttt,
                            ttt_decay=args.decay, budget_s=args.budget)
    if args.init is not None:
        head = load_eagle_head(args.init, target, torch.float32).train()
    else:
        head = init_eagle_head(target, shipped.token_ids, tcfg)
    tag = f"ttt{args.ttt}-s{args.steps}-lr{args.lr:g}-{'init' if args.init else 'fresh'}"
    tag += f"-d{args.decay:g}" if args.decay != 0.8 else ""
    t = time.time()
    stats = train_eagle(head, examples, tcfg, checkpoint=work / f"ckpt-{tag}.pt")
    out_dir = work / f"eagle-{tag}"
    save_eagle_head(head, out_dir, extra={"built_by": "scripts/eagle3.py", "seed": cfg.seed, "ttt_steps": args.ttt})
    loaded = load_eagle_head(out_dir, target, torch.float32)
    res = {"tag": tag, "training": stats, "wall_s": round(time.time() - t, 1), "init": str(args.init),
           "examples": {"diverse": len(diverse["examples"]), "code": len(code)},
           "label_tokens": sum(len(e["pos"]) for e in examples), **agreements(loaded, held_out(work))}
    (work / f"result-{tag}.json").write_text(json.dumps(res, indent=2))
    log.info("%s", res)
    return res


def ship(args, cfg) -> dict:
    """Replace the shipped EAGLE head with the one trained in ``args.dir`` (its result JSON next to
    it), update metrics.json's "eagle" section and the manifest's hashes (as shipped.export does)."""
    import shutil
    import subprocess

    from specdec.demo.shipped import MANIFEST, WEIGHTS_DIR, sha256, shipped_files
    from specdec.models.files import EAGLE_MARKER, EAGLE_WEIGHTS

    res = json.loads((args.work / f"result-{args.dir.name[len('eagle-'):]}.json").read_text())
    data = json.loads((args.work / "data.json").read_text())
    metrics = json.loads((WEIGHTS_DIR / "metrics.json").read_text())
    old = metrics["eagle"]
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    metrics["eagle"] = {
        "training": {**res["training"], "ttt_steps": args.ttt, "init": "the previous shipped head (warm start)",
                     "examples": res["examples"], "label_tokens": res["label_tokens"], "data": data,
                     "script": "scripts/eagle3.py (data, train: the build's functions)"},
        "trained_parameters": old["trained_parameters"], "head_vocab_size": old["head_vocab_size"],
        **{f"agreement_{n}_heldout": res[f"depth1_{n}"] for n in ("code", "chat")},
        **{f"agreement_depth{d}_{n}_heldout": res[f"depth{d}_{n}"] for d in (2, 3) for n in ("code", "chat")},
        "cost": old["cost"],
        "cpu": {"model_name": cpu, "cores": 2, "note": "shared with other jobs while training"},
        "previous_head": {**{k: v for k, v in old.items() if k.startswith("agreement")},
                          **{f"agreement_depth3_{n}_heldout": args.prev[f"depth3_{n}"] for n in ("code", "chat")},
                          "training": old["training"]},
    }
    shutil.copyfile(args.dir / EAGLE_WEIGHTS, WEIGHTS_DIR / "eagle.safetensors")
    shutil.copyfile(args.dir / EAGLE_MARKER, WEIGHTS_DIR / "eagle.json")
    (WEIGHTS_DIR / "metrics.json").write_text(json.dumps(metrics, indent=2))
    manifest = json.loads((WEIGHTS_DIR / MANIFEST).read_text())
    files = shipped_files(WEIGHTS_DIR)
    manifest["sha256"] = {name: sha256(WEIGHTS_DIR / name) for name in files}
    manifest["bytes"] = sum((WEIGHTS_DIR / name).stat().st_size for name in files)
    (WEIGHTS_DIR / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("shipped %s: %s", args.dir, metrics["eagle"])
    return metrics["eagle"]
