"""What crosses the actors hop: each row's new tokens and blocks, not its whole context.

The router's step loop owns every sequence's ids and block table; a worker keeps a copy of
each it has been sent. A call carries each row with its context and its block table cut to
what the worker has not seen, and ``bases``: for each row, the lengths (context, blocks) those
tails extend. Both only grow while a sequence lives (a prompt, chunk by chunk, then its
output; a block when the last one fills), so the worker's copies cut at ``base`` plus the
tails are the row's. A decode row costs a few tokens per step however long it is.

A worker that holds less than ``base`` of a row (it was restarted) raises ``MissingContext``;
the router then forgets what it sent and sends every row whole, which is also what it does
after any failed call.

    >>> sender, worker = Sender(), Receiver()
    >>> rows = [Ctx("a", [1, 2, 3], (7,))]
    >>> wire, bases = sender.cut(rows)
    >>> worker.restore(wire, bases)[0].context, bases
    ([1, 2, 3], {'a': (0, 0)})
    >>> sender.sent(rows)
    >>> wire, bases = sender.cut([Ctx("a", [1, 2, 3, 4, 5], (7, 9))])
    >>> wire[0].context, wire[0].blocks, bases, worker.restore(wire, bases)[0].blocks
    ([4, 5], (9,), {'a': (3, 1)}, (7, 9))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

R = TypeVar("R")  # a frozen dataclass with ``key``, ``context: list[int]``, ``blocks: tuple`` (Row, DraftRow)


class MissingContext(RuntimeError):
    """A worker was sent a tail for a context it does not hold (it restarted)."""


@dataclasses.dataclass(frozen=True)
class Ctx:
    """The smallest row (for the example above)."""

    key: str
    context: list[int]
    blocks: tuple[int, ...] = ()


class Sender:
    """The router's side: how much of each sequence's context a worker holds."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}

    def cut(self, rows: list[R], release: Iterable[str] = ()) -> tuple[list[R], dict[str, tuple[int, int]]]:
        """The rows with their contexts and blocks cut to what the worker has not seen, and the bases."""
        for key in release:
            self._sent.pop(key, None)
        bases = {}
        for r in rows:
            context, blocks = self._sent.get(r.key, (0, 0))
            bases[r.key] = (min(context, len(r.context)), min(blocks, len(r.blocks)))
        return [dataclasses.replace(r, context=r.context[bases[r.key][0]:], blocks=r.blocks[bases[r.key][1]:])
                for r in rows], bases

    def sent(self, rows: list[R]) -> None:
        """The worker now holds these rows' contexts and blocks."""
        self._sent.update({r.key: (len(r.context), len(r.blocks)) for r in rows})

    def forget(self) -> None:
        """After a failed call or a restarted worker: the next call sends every context whole."""
        self._sent.clear()


class Receiver:
    """The worker's side: every context it has been sent."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[list[int], tuple[int, ...]]] = {}

    def restore(self, rows: list[R], bases: dict[str, tuple[int, int]], release: Iterable[str] = ()) -> list[R]:
        for key in release:
            self._known.pop(key, None)
        out = []
        for r in rows:
            (base, block_base), (known, blocks) = bases[r.key], self._known.get(r.key, ([], ()))
            if len(known) < base or len(blocks) < block_base:
                raise MissingContext(f"sequence {r.key}: {len(known)} tokens and {len(blocks)} blocks held, "
                                     f"{base} and {block_base} assumed")
            context = known[:base] + r.context if base else list(r.context)
            table = blocks[:block_base] + tuple(r.blocks)
            self._known[r.key] = (context, table)
            out.append(dataclasses.replace(r, context=context, blocks=table))
        return out
