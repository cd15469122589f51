"""The unit's processes on this node, found by the titles Ray gives them, for operators' checks
(memory, open files) and for fault tests (kill one as a crash would).

Ray names a worker process after its actor: ``ray::ServeReplica:<app>:<deployment>`` for a
Serve replica (SpecRouter, Ingress), ``ray::TargetWorker`` / ``ray::DraftWorker`` for a unit's
model workers, ``ray::ServeController`` and ``ray::ProxyActor`` for Serve's own (the title
gains ``.method`` while a call runs). Only this node's processes are visible: the checks run
on the node they measure.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import psutil

ROLES = {
    "router": "ServeReplica:{app}:SpecRouter",
    "ingress": "ServeReplica:{app}:Ingress",
    "target": "TargetWorker",
    "draft": "DraftWorker",
    "controller": "ServeController",
    "proxy": "ProxyActor",
}


@dataclass(frozen=True)
class Proc:
    role: str
    pid: int


def _title(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""
    return cmdline[0] if cmdline else ""


def find(app: str = "specdec") -> list[Proc]:
    """Every live process of the roles above, sorted by role then pid."""
    wanted = {role: "ray::" + pattern.format(app=app) for role, pattern in ROLES.items()}
    found = []
    for proc in psutil.process_iter():
        title = _title(proc)
        for role, prefix in wanted.items():
            if title == prefix or title.startswith(prefix + ".") or title.startswith(prefix + " "):
                found.append(Proc(role, proc.pid))
    return sorted(found, key=lambda p: (p.role, p.pid))


def pids(role: str, app: str = "specdec") -> list[int]:
    return [p.pid for p in find(app) if p.role == role]


def kill(role: str, app: str = "specdec", *, wait_s: float = 0.0) -> int:
    """SIGKILL the one process of ``role`` (a crash: no cleanup runs); its pid. ``wait_s``: how
    long to wait for there to be exactly one (Serve may be replacing a replica that failed its
    health check after an earlier kill: for a moment there are none, or two)."""
    deadline = time.monotonic() + wait_s
    found = pids(role, app)
    while len(found) != 1 and time.monotonic() < deadline:
        time.sleep(0.25)
        found = pids(role, app)
    if len(found) != 1:
        raise RuntimeError(f"expected one {role} process of {app!r}, found {found}")
    os.kill(found[0], signal.SIGKILL)
    return found[0]


@dataclass(frozen=True)
class Usage:
    rss_bytes: int
    open_files: int  # file descriptors: files, sockets, pipes


def usage(pid: int) -> Usage | None:
    """A process's resident memory and open descriptors (None if it is gone)."""
    try:
        proc = psutil.Process(pid)
        return Usage(proc.memory_info().rss, proc.num_fds())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
