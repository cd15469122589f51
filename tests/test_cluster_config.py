"""The cluster files agree with each other and with Ray: the RayService embeds the GPU Serve
config, `specdec check-config` passes every YAML in the repo and rejects what Ray would drop
or only notice at deploy time."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from deployments.app import unit_bundles
from deployments.autoscaling import POLICY_PATH
from deployments.config import UnitArgs
from deployments.lint import lint_config, lint_file
from deployments.operate import separate_ingress
from specdec.cli import main as specdec_main

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
GPU_CONFIG = CLUSTER / "serve_config.gpu.yaml"
REPO_YAML = sorted([ROOT / "serve_config.yaml", *CLUSTER.glob("*.yaml")])

sys.path.insert(0, str(ROOT))  # `cluster` is a folder of the repo, not an installed package
from cluster.render import render  # noqa: E402


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_rayservice_embeds_the_gpu_serve_config():
    manifest = (CLUSTER / "rayservice.yaml").read_text()
    assert render(manifest, GPU_CONFIG.read_text()) == manifest, "run `python -m cluster.render`"
    assert yaml.safe_load(manifest)["spec"]["serveConfigV2"] == GPU_CONFIG.read_text()
    assert subprocess.run([sys.executable, "-m", "cluster.render", "--check"], cwd=ROOT).returncode == 0


def test_render_rewrites_only_the_block():
    manifest = (CLUSTER / "rayservice.yaml").read_text()
    changed = GPU_CONFIG.read_text().replace("max_replicas: 8 ", "max_replicas: 6 ")
    rendered = render(manifest, changed)
    before, after = yaml.safe_load(manifest), yaml.safe_load(rendered)
    assert yaml.safe_load(after["spec"]["serveConfigV2"]) == yaml.safe_load(changed) != load(GPU_CONFIG)
    assert after["spec"]["rayClusterConfig"] == before["spec"]["rayClusterConfig"]
    assert rendered.splitlines()[:8] == manifest.splitlines()[:8]  # the header comments stay
    assert render(rendered, GPU_CONFIG.read_text()) == manifest
    with pytest.raises(ValueError):
        render("apiVersion: ray.io/v1\nkind: RayService\n", GPU_CONFIG.read_text())


@pytest.mark.parametrize("path", REPO_YAML, ids=[p.name for p in REPO_YAML])
def test_every_yaml_in_the_repo_is_clean(path):
    assert lint_file(path) == []


def test_check_config_cli_exit_codes_and_one_line_per_problem(tmp_path, capsys):
    assert specdec_main(["check-config", *map(str, CLUSTER.glob("*.yaml"))]) == 0
    assert capsys.readouterr().out == ""
    config = load(GPU_CONFIG)
    router = config["applications"][0]["deployments"][0]
    router["max_replicaz"] = 2
    router["autoscaling_config"]["upscale_delai_s"] = 1
    config["applications"][0]["args"]["speculation"]["mdoe"] = "draft"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    assert specdec_main(["check-config", str(bad), str(GPU_CONFIG)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{bad}: ") for line in lines), lines
    for key in ("max_replicaz", "upscale_delai_s", "mdoe"):
        assert sum(key in line for line in lines) == 1, (key, lines)


def test_the_specdec_package_does_not_import_ray():
    code = "import sys, specdec.cli; specdec.cli.build_parser(); sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def mutated(change) -> list[str]:
    config = load(GPU_CONFIG)
    change(config["applications"][0], config["applications"][0]["deployments"][0]["autoscaling_config"])
    return lint_config(config)


def test_lint_catches_what_rays_schema_lets_through():
    # autoscaling_config is `Dict | AutoscalingConfig` in Ray's schema: invalid values pass as a dict.
    problems = mutated(lambda app, auto: auto.update(min_replicas=9))
    assert len(problems) == 1 and "min_replicas" in problems[0]
    problems = mutated(lambda app, auto: auto.update(downscale_delay_s=-1))
    assert len(problems) == 1 and "downscale_delay_s" in problems[0]
    # A policy that does not import would stop Ray's whole parse with an ImportError.
    problems = mutated(lambda app, auto: auto["policy"].update(policy_function="deployments.autoscaling:Nope"))
    assert len(problems) == 1 and "does not import" in problems[0]
    problems = mutated(lambda app, auto: auto["policy"]["policy_kwargs"].update(target_tps=5))
    assert len(problems) == 1 and "target_tps" in problems[0]
    problems = mutated(lambda app, auto: auto["policy"]["policy_kwargs"].update(downscale_headroom=3))
    assert len(problems) == 1 and "downscale_headroom" in problems[0]
    problems = mutated(lambda app, auto: auto.update(policy={"policy_function": "math:floor", "policy_kwargs": {"a": 1}}))
    assert len(problems) == 1 and "ignored by Ray for a function policy" in problems[0]
    problems = mutated(lambda app, auto: auto["policy"]["policy_kwargs"].update(max_requests_per_unit=512))
    assert len(problems) == 1 and "max_requests_per_unit" in problems[0]


def test_lint_catches_capacity_mismatches_and_wrong_names():
    problems = mutated(lambda app, auto: app["deployments"][0].update(max_ongoing_requests=512))
    assert any("max_concurrent_requests" in p for p in problems), problems
    problems = mutated(lambda app, auto: app["deployments"][1].update(max_ongoing_requests=16))
    assert len(problems) == 1 and "unreachable" in problems[0] and "proxy" in problems[0], problems
    problems = mutated(lambda app, auto: app["deployments"][1].update(name="Ingres"))
    assert any("'Ingres'" in p for p in problems), problems
    problems = mutated(lambda app, auto: app["deployments"][0].update(num_replicas=2))
    assert len(problems) == 1 and "num_replicas" in problems[0]
    problems = mutated(lambda app, auto: app["deployments"][0]["backpressure_config"].update(status_code=418))
    assert len(problems) == 1 and "status_code" in problems[0]


def test_lint_reads_the_rayservice_and_the_launcher_config(tmp_path):
    manifest = load(CLUSTER / "rayservice.yaml")
    manifest["spec"]["serveConfigV2"] = manifest["spec"]["serveConfigV2"].replace("proxy_location", "proxy_locaton")
    manifest["spec"]["rayClusterConfig"]["rayVersion"] = "2.9.0"
    bad = tmp_path / "rayservice.yaml"
    bad.write_text(yaml.safe_dump(manifest))
    problems = lint_file(bad)
    assert any(p.startswith("spec.serveConfigV2: proxy_locaton: unknown key") for p in problems), problems
    assert any("rayVersion" in p for p in problems), problems
    launcher = load(CLUSTER / "cluster.yaml")
    launcher["max_worker"] = launcher.pop("max_workers")
    launcher["available_node_types"]["gpu_worker"]["resources"]["GPU"] = 0.5
    launcher["head_node_type"] = "boss"
    bad = tmp_path / "cluster.yaml"
    bad.write_text(yaml.safe_dump(launcher))
    problems = "\n".join(lint_file(bad))
    assert "max_worker" in problems and "GPU" in problems and "boss" in problems, problems


def test_one_unit_fills_one_gpu_node_and_the_maxima_agree():
    config = load(GPU_CONFIG)
    app = config["applications"][0]
    router = {d["name"]: d for d in app["deployments"]}["SpecRouter"]
    unit = UnitArgs.model_validate({k: v for k, v in app["args"].items() if k != "ingress_cpus"})
    assert unit.colocation == "actors"
    bundles = unit_bundles(unit)
    assert len(bundles) == 3 and sum(b.get("GPU", 0) for b in bundles) == pytest.approx(1.0)
    assert 0 < bundles[1]["GPU"] < 1 and 0 < bundles[2]["GPU"] < 1  # fractional: one GPU per unit
    launcher = load(CLUSTER / "cluster.yaml")["available_node_types"]["gpu_worker"]
    group = load(CLUSTER / "rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    pod_cpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert sum(b["CPU"] for b in bundles) <= min(launcher["resources"]["CPU"], pod_cpus)
    assert launcher["resources"]["GPU"] == 1
    max_units = router["autoscaling_config"]["max_replicas"]
    assert max_units == launcher["max_workers"] == group["maxReplicas"]
    assert router["autoscaling_config"]["policy"]["policy_function"] == POLICY_PATH
    assert router["backpressure_config"] == {"status_code": 429, "retry_after_s": 5}


def test_the_image_installs_the_packages_and_the_pinned_ray():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:(\S+)", dockerfile, re.M)
    assert base and base.group(1).startswith(f"{ray.__version__}-py311-gpu")
    find = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include = \[([^\]]*)\]", (ROOT / "pyproject.toml").read_text())
    packages = re.findall(r'"([^"]+)"', find.group(1))
    assert packages
    for pattern in packages:
        assert re.search(rf"^COPY .*\b{pattern.rstrip('*')}\b", dockerfile, re.M), pattern
    assert re.search(r"^RUN pip install .*\s\.\s", dockerfile, re.M)


LOCAL_CONFIG = ROOT / "serve_config.yaml"


def local_mutated(change) -> list[str]:
    """serve_config.yaml in the layout with an Ingress deployment, then ``change(config, unit, ingress)``."""
    config = separate_ingress(load(LOCAL_CONFIG))
    deps = {d["name"]: d for d in config["applications"][0]["deployments"]}
    change(config, deps["SpecRouter"], deps["Ingress"])
    return lint_config(config)


def test_backpressure_unreachable_when_the_ingress_admits_no_more_than_the_unit_holds():
    # One unit: 16 running + 64 queued = 80 held. An Ingress that admits 64 (or 80) never
    # sends the 81st to the unit, so the unit's 503 never fires.
    for admitted in (64, 80):
        problems = local_mutated(lambda c, router, ingress, n=admitted: ingress.update(max_ongoing_requests=n))
        assert problems == [(
            f"applications[0].deployments[1].max_ongoing_requests: {admitted} (set here) <= the 80 "
            "requests SpecRouter holds per caller (16 running x 1 replica + 64 queued): backpressure "
            "is unreachable, a full unit never answers 503/429 + Retry-After and the excess waits at "
            "the proxy instead; set Ingress max_ongoing_requests above 80 (or lower SpecRouter "
            "max_queued_requests)"
        )], problems
    assert local_mutated(lambda c, router, ingress: ingress.update(max_ongoing_requests=81)) == []
    # The running share grows with the units' max_replicas (the queue is per caller: it does not).
    problems = mutated(lambda app, auto: app["deployments"][1].update(max_ongoing_requests=2080))
    assert len(problems) == 1 and "256 running x 8 replicas (max_replicas) + 32 queued" in problems[0], problems
    assert mutated(lambda app, auto: app["deployments"][1].update(max_ongoing_requests=2081)) == []
    problems = mutated(lambda app, auto: app["deployments"][0]["autoscaling_config"].update(max_replicas=32))
    assert len(problems) == 1 and "above 8224" in problems[0], problems


def test_an_unset_ingress_limit_is_the_builders_not_serves():
    # 256 from the builder (deployments/config.py), not Serve's 5: 256 > 80 passes, 256 <= 16 + 300 does not.
    assert local_mutated(lambda c, router, ingress: ingress.pop("max_ongoing_requests")) == []
    problems = local_mutated(lambda c, router, ingress: (ingress.pop("max_ongoing_requests"),
                                                         router.update(max_queued_requests=300)))
    assert len(problems) == 1 and "256 (the builder's default, deployments/config.py) <= the 316" in problems[0]


def test_unbounded_queues_are_flagged():
    problems = local_mutated(lambda c, router, ingress: router.update(max_queued_requests=-1))
    assert len(problems) == 1 and "max_queued_requests: -1 (no limit)" in problems[0], problems
    problems = local_mutated(lambda c, router, ingress: ingress.update(max_queued_requests=-1))
    assert len(problems) == 1, problems
    assert problems[0].startswith("applications[0].deployments[1].max_queued_requests: -1 (no limit)")
    assert "set Ingress max_queued_requests" in problems[0]
    problems = local_mutated(lambda c, router, ingress: ingress["backpressure_config"].pop("retry_after_s"))
    assert problems == [(
        "applications[0].deployments[1].backpressure_config.retry_after_s: not set: the proxy refuses "
        "past Ingress max_queued_requests without a Retry-After header; set it (seconds)"
    )]
    # A config without SpecRouter / Ingress entries runs on the builder's defaults: both queues
    # bounded, 503 + Retry-After past them.
    assert local_mutated(lambda c, router, ingress: c["applications"][0].pop("deployments")) == []


def test_a_request_timeout_is_required(tmp_path):
    problems = local_mutated(lambda c, router, ingress: c["http_options"].pop("request_timeout_s"))
    assert len(problems) == 1 and problems[0].startswith("http_options.request_timeout_s: not set"), problems
    for off in (0, -1):
        problems = local_mutated(lambda c, router, ingress, t=off: c["http_options"].update(request_timeout_s=t))
        assert len(problems) == 1 and problems[0].startswith(f"http_options.request_timeout_s: {off}:"), problems
    problems = local_mutated(lambda c, router, ingress: c.pop("http_options"))
    assert len(problems) == 1 and "request_timeout_s: not set" in problems[0], problems
    manifest = (CLUSTER / "rayservice.yaml").read_text().replace("request_timeout_s: 600", "# none")
    (tmp_path / "rayservice.yaml").write_text(manifest)
    problems = lint_file(tmp_path / "rayservice.yaml")
    assert len(problems) == 1 and problems[0].startswith("spec.serveConfigV2: http_options.request_timeout_s: not set")


def test_the_shipped_configs_can_refuse():
    """The numbers the comments explain: a full unit answers 503/429 with Retry-After."""
    local = separate_ingress(load(LOCAL_CONFIG))
    for config, status, held, admitted in ((local, 503, 80, 256), (load(GPU_CONFIG), 429, 2080, 4096)):
        assert config["http_options"]["request_timeout_s"] > 0
        deps = {d["name"]: d for d in config["applications"][0]["deployments"]}
        router, ingress = deps["SpecRouter"], deps["Ingress"]
        units = (router.get("autoscaling_config") or {}).get("max_replicas", router.get("num_replicas", 1))
        ongoing = router.get("max_ongoing_requests", config["applications"][0]["args"]["max_concurrent_requests"])
        assert ongoing * units + router["max_queued_requests"] == held < admitted == ingress["max_ongoing_requests"]
        assert ingress["max_queued_requests"] > 0
        for dep in (router, ingress):
            assert dep["backpressure_config"]["status_code"] == status and dep["backpressure_config"]["retry_after_s"] > 0
    # serve_config.yaml itself: the unit serves HTTP. It holds 16 + 64 generations, admits more
    # calls than that (so its own 503 fires), and the proxy's queue before it refuses with a Retry-After.
    config = load(LOCAL_CONFIG)
    app = config["applications"][0]
    assert app["args"]["ingress"] == "in_unit" and [d["name"] for d in app["deployments"]] == ["SpecRouter"]
    unit = app["deployments"][0]
    assert unit["max_ongoing_requests"] > app["args"]["max_concurrent_requests"] + 64 == 80
    assert unit["max_queued_requests"] > 0
    assert unit["backpressure_config"]["status_code"] == 503 and unit["backpressure_config"]["retry_after_s"] > 0
    assert lint_config(config) == []


def in_unit_config(change=lambda app, unit: None) -> list[str]:
    """serve_config.yaml (``ingress: in_unit``: its SpecRouter entry is an ingress's, 256 admitted,
    256 queued at the proxy), then ``change(app, unit_entry)``."""
    config = load(LOCAL_CONFIG)
    app = config["applications"][0]
    unit = next(d for d in app["deployments"] if d["name"] == "SpecRouter")
    change(app, unit)
    return lint_config(config)


def test_an_in_unit_application_is_the_unit_alone_and_its_own_refusal_must_be_reachable():
    assert in_unit_config() == []
    # The Ingress deployment does not exist in this layout: an entry for it is a mistake.
    problems = in_unit_config(lambda app, unit: app["deployments"].append({"name": "Ingress", "num_replicas": 1}))
    assert problems == ["applications[0].deployments[1].name: 'Ingress' is not one of ['SpecRouter']"], problems
    # The unit holds 16 + 64 generations before its own 503: admitting no more than that at the
    # replica leaves the excess at the proxy.
    problems = in_unit_config(lambda app, unit: unit.update(max_ongoing_requests=80))
    assert len(problems) == 1 and "80 <= the 80 generations the unit holds" in problems[0], problems
    assert in_unit_config(lambda app, unit: unit.update(max_ongoing_requests=81)) == []
    problems = in_unit_config(lambda app, unit: unit.update(max_queued_requests=-1))
    assert len(problems) == 1 and "max_queued_requests: -1 (no limit)" in problems[0], problems
    problems = in_unit_config(lambda app, unit: unit["backpressure_config"].pop("retry_after_s"))
    assert problems == ["applications[0].deployments[0].backpressure_config.retry_after_s: not set: the proxy "
                        "refuses past SpecRouter max_queued_requests without a Retry-After header; set it (seconds)"]
    # The speculation-aware policy may count on the generations the unit holds (16 + 64), not on
    # the API calls its replica admits (256).
    def autoscaled(per_unit):
        def change(app, unit):
            unit.pop("num_replicas")
            unit["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2, "policy": {
                "policy_function": "deployments.autoscaling:SpeculationAwarePolicy",
                "policy_kwargs": {"target_tokens_per_s": 20, "max_requests_per_unit": per_unit}}}
        return in_unit_config(change)

    assert autoscaled(80) == []
    problems = autoscaled(256)
    assert len(problems) == 1 and "max_requests_per_unit: 256 > the generations the unit holds (80)" in problems[0], \
        problems
    # One unit only: more models need the Ingress.
    problems = in_unit_config(lambda app, unit: app["args"].update(units=[{"models": {"target": "t"}}]))
    assert any("ingress: in_unit serves one unit's model" in p for p in problems), problems
