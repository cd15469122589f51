"""What the layers above the library add to it, found through entry points, so that the library
never imports them: the Serve layer (``deployments``) registers its ``specdec`` subcommands and
the local server that ``specdec sweep --http`` starts (see ``pyproject.toml``).

    [project.entry-points."specdec.commands"]      name = "module:register"   register(subparsers)
    [project.entry-points."specdec.local_server"]  name = "module:function"   see ``local_server``
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.metadata import entry_points

COMMANDS, LOCAL_SERVER = "specdec.commands", "specdec.local_server"


def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Let each installed plugin add its subcommands (its module must import quickly: every
    ``specdec`` invocation loads it; heavy imports belong in the command's function)."""
    for entry in entry_points(group=COMMANDS):
        entry.load()(subparsers)


def local_server() -> Callable[..., Callable[[], None]]:
    """``start(models: dict, *, port: int, name: str, max_num_seqs: int) -> stop()``: serves
    ``models`` over HTTP on 127.0.0.1 until ``stop()`` is called."""
    found = list(entry_points(group=LOCAL_SERVER))
    if not found:
        raise ValueError("no local server is installed (the Serve layer, `deployments`, provides one)")
    return found[0].load()
