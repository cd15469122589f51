"""Where specdec keeps its files: ``$SPECDEC_HOME`` (default ``~/.cache/specdec``).

The one place the variable is read; the demo models (``demo/``), the benchmark's tiny pair
(``tiny/``) and the trace files (``traces/``) all live under it. Read at call time, so a test
or a process that sets the variable after import is honoured. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["specdec_home"]


def specdec_home() -> Path:
    """``$SPECDEC_HOME`` if set and not empty, else ``~/.cache/specdec``; ``~`` expanded."""
    return Path(os.environ.get("SPECDEC_HOME") or (Path.home() / ".cache" / "specdec")).expanduser()
