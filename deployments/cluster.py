"""A local Ray cluster driven the way an operator drives one: ``ray start --head`` with Ray
2.60's token authentication, configs applied with ``serve deploy``, state read with
``serve status``. Only the ``ray`` and ``serve`` command lines are used, so what works here
works from an operator's shell.

The head runs with ``--block`` as a child process: interrupting it (SIGINT; it ignores SIGTERM)
stops this cluster's processes only, where ``ray stop`` would stop every Ray process on the
machine. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deployments.proxy import CALLBACK, CALLBACK_ENV


@dataclass
class LocalCluster:
    home: Path  # the cluster's temp dir, SPECDEC_HOME (traces) and the configs it was sent
    dashboard_port: int = 8277
    gcs_port: int = 6391
    metrics_port: int = 8278
    num_cpus: int = 8
    env_extra: dict = field(default_factory=dict)
    _head: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def env(self) -> dict:
        """What every ``ray`` / ``serve`` command (and so every Ray process) runs with: token
        authentication as Ray 2.60 enables it, the proxy's middleware, our home."""
        return {**os.environ, "RAY_AUTH_MODE": "token", CALLBACK_ENV: CALLBACK,
                "SPECDEC_HOME": str(self.home / "specdec"), **self.env_extra}

    def run(self, *args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=env or self.env, capture_output=True, text=True, timeout=timeout)

    def start(self, timeout: float = 120) -> None:
        if self.run("serve", "status", "-a", self.address, timeout=60).returncode == 0:
            raise RuntimeError(f"a Ray cluster already answers at {self.address}: stop it or choose other ports")
        temp = self.home / "ray"
        temp.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "ray-start.log", "w")
        self._head = subprocess.Popen(
            ["ray", "start", "--head", "--block", f"--port={self.gcs_port}", "--node-ip-address=127.0.0.1",
             f"--dashboard-port={self.dashboard_port}", "--dashboard-host=127.0.0.1",
             f"--metrics-export-port={self.metrics_port}", f"--num-cpus={self.num_cpus}", f"--temp-dir={temp}",
             "--disable-usage-stats"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._head.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start failed: {(self.home / 'ray-start.log').read_text()[-2000:]}")
            if self.run("serve", "status", "-a", self.address, timeout=60).returncode == 0:
                return
            time.sleep(1)

    def stop(self, timeout: float = 15) -> None:
        """SIGINT to the head (``--block``: it stops what it started), SIGKILL to its process
        group after ``timeout``. A clean stop takes a few seconds; a head whose cluster had
        replicas killed under it waited out a whole minute on SIGINT in CI, and a SIGTERM to the
        group did not end it either."""
        if self._head is None:
            return
        self._head.send_signal(signal.SIGINT)
        try:
            self._head.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self._head.pid, signal.SIGKILL)
            self._head.wait(10)
        self._head = None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def deploy(self, config: dict, name: str = "serve_config.yaml") -> Path:
        """``serve deploy`` a config (written to ``home/name``); returns its path."""
        path = self.home / name
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        done = self.run("serve", "deploy", str(path), "-a", self.address)
        if done.returncode != 0:
            raise RuntimeError(f"serve deploy failed: {done.stdout}{done.stderr}")
        return path

    def status(self) -> dict:
        done = self.run("serve", "status", "-a", self.address, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"serve status failed: {done.stdout}{done.stderr}")
        return yaml.safe_load(done.stdout) or {}

    def wait_running(self, app: str = "specdec", timeout: float = 240) -> dict:
        """Poll ``serve status`` until ``app`` is RUNNING with every deployment HEALTHY."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            state = (status.get("applications") or {}).get(app, {})
            healthy = all(d.get("status") == "HEALTHY" for d in (state.get("deployments") or {}).values())
            if state.get("status") == "RUNNING" and healthy and state.get("deployments"):
                return state
            if state.get("status") == "DEPLOY_FAILED":
                raise RuntimeError(f"{app} failed to deploy: {state.get('message')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{app} not RUNNING after {timeout} s: {state}")
            time.sleep(1)

    def metric_series(self, prefix: str = "ray_specdec_") -> int:
        """How many distinct series (name and label set) the node's Prometheus endpoint has."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).text
        return sum(1 for line in text.splitlines() if line.startswith(prefix))
