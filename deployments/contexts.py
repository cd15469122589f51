"""What crosses the actors hop: each row's new tokens, not its whole context.

The router's step loop owns every sequence's ids; a worker keeps a copy of each context it
has been sent. A call carries each row with its context cut to the tokens the worker has not
seen, and ``bases``: for each row, the length of context those tokens extend. Contexts only
grow (a prompt, chunk by chunk, then its output), so the worker's copy cut at ``base`` plus
the tail is the row's context. A decode row costs a few tokens per step however long it is.

A worker that holds fewer than ``base`` tokens of a row (it was restarted) raises
``MissingContext``; the router then forgets what it sent and sends every context whole,
which is also what it does after any failed call.

    >>> sender, worker = Sender(), Receiver()
    >>> rows = [Ctx("a", [1, 2, 3])]
    >>> wire, bases = sender.cut(rows)
    >>> worker.restore(wire, bases)[0].context, bases
    ([1, 2, 3], {'a': 0})
    >>> sender.sent(rows)
    >>> wire, bases = sender.cut([Ctx("a", [1, 2, 3, 4, 5])])
    >>> wire[0].context, bases, worker.restore(wire, bases)[0].context
    ([4, 5], {'a': 3}, [1, 2, 3, 4, 5])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

R = TypeVar("R")  # a frozen dataclass with ``key: str`` and ``context: list[int]`` (Row, DraftRow)


class MissingContext(RuntimeError):
    """A worker was sent a tail for a context it does not hold (it restarted)."""


@dataclasses.dataclass(frozen=True)
class Ctx:
    """The smallest row (for the example above)."""

    key: str
    context: list[int]


class Sender:
    """The router's side: how much of each sequence's context a worker holds."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def cut(self, rows: list[R], release: Iterable[str] = ()) -> tuple[list[R], dict[str, int]]:
        """The rows with their contexts cut to what the worker has not seen, and the bases."""
        for key in release:
            self._sent.pop(key, None)
        bases = {r.key: min(self._sent.get(r.key, 0), len(r.context)) for r in rows}
        return [dataclasses.replace(r, context=r.context[bases[r.key]:]) for r in rows], bases

    def sent(self, rows: list[R]) -> None:
        """The worker now holds these rows' contexts."""
        self._sent.update({r.key: len(r.context) for r in rows})

    def forget(self) -> None:
        """After a failed call or a restarted worker: the next call sends every context whole."""
        self._sent.clear()


class Receiver:
    """The worker's side: every context it has been sent."""

    def __init__(self) -> None:
        self._known: dict[str, list[int]] = {}

    def restore(self, rows: list[R], bases: dict[str, int], release: Iterable[str] = ()) -> list[R]:
        for key in release:
            self._known.pop(key, None)
        out = []
        for r in rows:
            base, known = bases[r.key], self._known.get(r.key, [])
            if len(known) < base:
                raise MissingContext(f"sequence {r.key}: {len(known)} tokens held, {base} assumed")
            context = known[:base] + r.context if base else list(r.context)
            self._known[r.key] = context
            out.append(dataclasses.replace(r, context=context))
        return out
