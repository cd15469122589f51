"""Copy cluster/serve_config.gpu.yaml into cluster/rayservice.yaml's ``serveConfigV2``.

The Serve config is the one source of truth; the RayService manifest embeds it as a YAML
string (KubeRay's format). Everything else in rayservice.yaml is edited by hand; only the
``serveConfigV2: |`` block is rewritten, comments included.

    python -m cluster.render           # rewrite the block in place
    python -m cluster.render --check   # exit 1 if rayservice.yaml is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CLUSTER = Path(__file__).resolve().parent
SERVE_CONFIG = CLUSTER / "serve_config.gpu.yaml"
RAYSERVICE = CLUSTER / "rayservice.yaml"

_BLOCK = re.compile(r"^(?P<indent> *)serveConfigV2: *\|[-+0-9]*\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def render(manifest: str, serve_config: str) -> str:
    """``manifest`` with its ``serveConfigV2: |`` block replaced by ``serve_config``."""
    if "\t" in serve_config:
        raise ValueError("the serve config contains tabs: YAML block scalars cannot hold them")
    lines = manifest.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _BLOCK.match(line)), None)
    if start is None:
        raise ValueError("the manifest has no `serveConfigV2: |` line")
    indent = _indent(lines[start])
    end = start + 1  # the block: blank lines and lines indented deeper than the key
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1  # trailing blank lines separate the next key: keep them
    pad = " " * (indent + 2)
    body = [pad + line.rstrip() + "\n" if line.strip() else "\n" for line in serve_config.splitlines()]
    return "".join([*lines[:start], " " * indent + "serveConfigV2: |\n", *body, *lines[end:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if rayservice.yaml is stale")
    args = parser.parse_args(argv)
    current = RAYSERVICE.read_text()
    rendered = render(current, SERVE_CONFIG.read_text())
    if args.check:
        if rendered != current:
            print(f"{RAYSERVICE} is stale: run `python -m cluster.render`", file=sys.stderr)
            return 1
        return 0
    if rendered != current:
        RAYSERVICE.write_text(rendered)
        print(f"rendered {SERVE_CONFIG.name} into {RAYSERVICE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
