"""Operator flags through user_config, the way `serve deploy serve_config.yaml` applies them."""

import copy

import httpx
import pytest
import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema

PORT = 8125


@pytest.fixture(scope="module")
def client():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:  # a failed setup must not leave this Ray running for the modules after it
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        yield serve.context._get_global_client()
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(client, config: dict) -> None:
    """What `serve deploy` does: hand the controller a declarative config."""
    client.deploy_apps(ServeDeploySchema.model_validate(config), _blocking=True)


def test_kill_switch_through_user_config_applies_without_a_restart(client, llama_pair):
    config = {
        "applications": [
            {
                "name": "flags",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "args": {
                    "models": {"target": str(llama_pair["target"]), "draft": str(llama_pair["draft"]),
                               "dtype": "float32", "served_model_name": "tiny"},
                    "colocation": "in_process",
                    "resources": {"target_cpus": 0.25},
                },
                "deployments": [{"name": "SpecRouter", "user_config": {"kill_switch": False}}],
            }
        ]
    }
    deploy(client, config)
    router = serve.get_deployment_handle("SpecRouter", app_name="flags")
    before = router.info.remote().result()
    body = {"model": "tiny", "prompt": "The cat sees", "max_tokens": 24, "temperature": 0,
            "speculation": {"mode": "draft"}}
    assert httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=60).json()["speculation"]["drafted_tokens"] > 0

    flipped = copy.deepcopy(config)
    flipped["applications"][0]["deployments"][0]["user_config"] = {"kill_switch": True}
    deploy(client, flipped)
    after = router.info.remote().result()
    assert after["replica"] == before["replica"]  # reconfigured in place, not restarted
    assert after["policy"]["kill_switch"] is True
    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=60).json()
    assert r["speculation"]["mode"] == "off" and r["speculation"]["drafted_tokens"] == 0
