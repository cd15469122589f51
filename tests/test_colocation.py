"""Co-location on a simulated two-node GPU cluster: each unit's router, target and draft
share one node (the replica's STRICT_PACK placement group)."""

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from deployments.app import build_unit


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=2, num_gpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:  # a failed setup must not leave this Ray running for the modules after it
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def test_each_unit_packs_router_target_and_draft_on_one_gpu_node(cluster, llama_pair):
    args = {
        "models": {"target": str(llama_pair["target"]), "draft": str(llama_pair["draft"]), "dtype": "float32"},
        "colocation": "actors",
        # 0.5 + 0.25 GPU per unit: two units cannot share one single-GPU node.
        "resources": {"router_cpus": 0.1, "target_cpus": 0.5, "target_gpus": 0.5, "draft_cpus": 0.25, "draft_gpus": 0.25},
    }
    serve.start(http_options={"host": "127.0.0.1", "port": 8124})
    serve.run(build_unit(args, num_replicas=2), name="units", route_prefix=None)
    handle = serve.get_app_handle("units")
    infos = {}
    for _ in range(40):
        info = handle.info.remote().result(timeout_s=60)
        infos[info["replica"]] = info
        if len(infos) == 2:
            break
    assert len(infos) == 2, infos
    gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")}
    for info in infos.values():
        assert info["workers"]["target"] == info["workers"]["draft"] == info["node_id"]
        assert info["node_id"] in gpu_nodes
    assert len({info["node_id"] for info in infos.values()}) == 2
