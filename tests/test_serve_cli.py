"""The `serve` CLI as an operator runs it (README.md, Configuration): `ray start --head`, then
`serve deploy` and `serve status` with `RAY_AUTH_MODE=token`. Ray 2.60 turns token
authentication on for local clusters and writes the token to ~/.ray/auth_token, which the CLI
reads only when told the mode; without it the CLI is refused (the negative control)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD, HTTP_PORT, GCS_PORT = 8277, 8127, 6391


def _run(args: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_AUTH_MODE": "token",
           "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.proxy:middlewares",
           "SPECDEC_HOME": str(tmp_path_factory.mktemp("home"))}
    started = _run(["ray", "start", "--head", f"--port={GCS_PORT}", f"--dashboard-port={DASHBOARD}",
                    "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp}", "--disable-usage-stats"], env)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield env
    finally:
        _run(["ray", "stop", "--force"], env)


def _config(tmp_path: Path, pair: dict) -> Path:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = HTTP_PORT
    models = config["applications"][0]["args"]["models"]
    models.update(target=str(pair["target"]), draft=str(pair["draft"]), dtype="float32", draft_dtype="float32")
    models.pop("eagle_head"), models.pop("medusa_heads"), models.pop("early_exit_adapter")
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _status(env: dict) -> subprocess.CompletedProcess:
    return _run(["serve", "status", "-a", f"http://127.0.0.1:{DASHBOARD}"], env, timeout=60)


def test_serve_deploy_and_status_as_the_readme_says(cluster, llama_pair, tmp_path):
    env = cluster
    refused = _status({k: v for k, v in env.items() if k != "RAY_AUTH_MODE"})
    assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower()

    deployed = _run(["serve", "deploy", str(_config(tmp_path, llama_pair)), "-a", f"http://127.0.0.1:{DASHBOARD}"],
                    env)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    deadline, status = time.monotonic() + 240, {}
    while time.monotonic() < deadline:
        out = _status(env)
        assert out.returncode == 0, out.stdout + out.stderr
        status = yaml.safe_load(out.stdout) or {}
        app = (status.get("applications") or {}).get("specdec", {})
        if app.get("status") == "RUNNING":
            break
        assert app.get("status") != "DEPLOY_FAILED", out.stdout
        time.sleep(2)
    app = status["applications"]["specdec"]
    assert app["status"] == "RUNNING", status
    assert {d: s["status"] for d, s in app["deployments"].items()} == {"SpecRouter": "HEALTHY", "Ingress": "HEALTHY"}
    r = httpx.post(f"http://127.0.0.1:{HTTP_PORT}/v1/completions", timeout=60,
                   json={"model": str(llama_pair["target"]), "prompt": "The cat sees", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
