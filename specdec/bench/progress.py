"""Progress of the long commands (``specdec bench``, ``sweep``, ``quality``), on stderr.

A command is a row of phases (load, costs, warm-up, runs, ...). A phase is one line: the
command and phase, done / total, elapsed < time left (at the phase's average rate so far, so
a slow peer and a fast mode weigh alike), and what runs now:

    bench runs  37%|███▋      | 44/120 [02:10<03:45, hf-assisted-default, code, repeat 1/2]

Where it shows (``--progress`` / ``--no-progress``, else automatic):

- stderr is a terminal: the line redraws in place; a finished phase stays, the next starts below;
  log records go above the line (``tqdm.contrib.logging``) instead of through it;
- stderr is not a terminal (a pipe, a file, a CI log): nothing, unless ``--progress`` forces it;
  forced, a plain line at a phase's start, at most every ``LOG_INTERVAL_S`` and at its end.

Progress goes to stderr only; a command's report and JSON on stdout are the same bytes whatever
the setting (``Phase.print_stdout`` writes a result line, e.g. a sweep row, above a drawn line).
Library functions take a ``Phase`` and default to ``SILENT``, which counts nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TextIO, TypeVar

TTY_INTERVAL_S = 0.2  # a terminal redraws at most this often (tqdm's mininterval)
LOG_INTERVAL_S = 10.0  # a forced non-terminal stream gets a line at most this often
# tqdm's fields; ``postfix`` is ", " + what runs now
LINE_FORMAT = "{desc} {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar:10}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"

T = TypeVar("T")


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``, the same on every long command."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr: the phase, what runs now, done/total, elapsed and ETA "
                        "(default: only when stderr is a terminal; --progress forces it into a pipe or log, "
                        "one line per phase and every 10 s; --no-progress turns it off). stdout is unchanged")


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """One command's phases on ``stream`` (stderr). ``force``: True / False from the flags, None: a TTY only."""

    def __init__(self, command: str, *, force: bool | None = None, stream: TextIO | None = None,
                 interval_s: float | None = None):
        self.command = command
        self.stream = sys.stderr if stream is None else stream
        self.tty = _is_tty(self.stream)
        self.enabled = self.tty if force is None else force
        self.interval_s = interval_s if interval_s is not None else (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S)

    def phase(self, name: str, total: int) -> "Phase":
        """A phase of ``total`` units; use it as a context manager (its line ends on exit)."""
        return Phase(self if self.enabled else None, name, total)


class Phase:
    """One phase's line: ``now`` says what runs, ``advance`` counts what finished (any thread),
    ``drop`` takes out work that will not run (a configuration that failed)."""

    def __init__(self, progress: Progress | None, name: str, total: int):
        self._progress = progress
        self._lock = threading.Lock()
        self._exit = ExitStack()
        self._bar = None
        self._logged: tuple[float | None, tuple] = (None, ())  # when the last line was written, at which (n, total)
        if progress is not None:
            self._bar = self._open(progress, f"{progress.command} {name}", total)

    def _open(self, progress: Progress, desc: str, total: int):
        from tqdm import tqdm

        if progress.tty:  # drawn by tqdm itself; log records are written above it
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._exit.enter_context(logging_redirect_tqdm())
            return tqdm(total=total, desc=desc, file=progress.stream, mininterval=progress.interval_s,
                        smoothing=0, bar_format=BAR_FORMAT, dynamic_ncols=True, leave=True)
        # formatted by tqdm, written here as whole lines
        return tqdm(total=total, desc=desc, file=_Discard(), smoothing=0, bar_format=LINE_FORMAT)

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def now(self, what: str) -> None:
        """What runs now (shown at once on a terminal, with the next line elsewhere)."""
        if self._bar is not None:
            with self._lock:
                self._bar.set_postfix_str(what, refresh=self._progress.tty)
                self._maybe_line()

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)
                self._maybe_line()

    def drop(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.total = max(self._bar.n, self._bar.total - n)

    def counting(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, advancing this phase by one after each call."""
        def counted(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.advance()
            return result
        return counted

    def print_stdout(self, line: str) -> None:
        """A line for stdout (a result as it comes) that does not tear the line drawn on a terminal."""
        if self._bar is not None and self._progress.tty:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            with self._lock:
                if not self._progress.tty and self._logged[1] != (self._bar.n, self._bar.total):
                    self._line(self._bar)
                self._bar.close()
            self._bar = None
        self._exit.close()

    def _maybe_line(self) -> None:
        """Off a terminal: a line, if the last is ``interval_s`` old (the first at once)."""
        last = self._logged[0]
        if not self._progress.tty and (last is None or time.monotonic() - last >= self._progress.interval_s):
            self._line(self._bar)

    def _line(self, bar) -> None:
        self._progress.stream.write(str(bar).rstrip() + "\n")
        self._progress.stream.flush()
        self._logged = (time.monotonic(), (bar.n, bar.total))


class _Discard:
    """Where a line-mode bar draws: nowhere (its text is taken with ``str(bar)``)."""

    def write(self, s: str) -> None:
        pass

    def flush(self) -> None:
        pass


QUIET = Progress("", force=False)  # the default of the drivers: no phase writes anything
SILENT = Phase(None, "", 0)  # the default of library calls: counts nothing, writes nothing
