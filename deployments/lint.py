"""Lint the project's YAML: Serve configs, the KubeRay RayService, the Ray cluster launcher.

Ray 2.60 validates a Serve config with pydantic models that ignore unknown keys, so a
misspelled ``num_replicaz`` disappears without a word; ``autoscaling_config`` is typed
``Dict | AutoscalingConfig``, so an invalid one (``min_replicas`` > ``max_replicas``, a
negative delay) passes the schema as a plain dict; and a custom autoscaling policy that does
not import stops the whole parse with an ImportError. ``lint_config`` reports all of these,
one line per problem, plus what our builder (``deployments.app``) would refuse or silently
do differently. ``specdec check-config FILE...`` runs it.
"""

from __future__ import annotations

import copy
import inspect
import json
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
from ray.serve.schema import RayActorOptionsSchema, ServeDeploySchema

from deployments.autoscaling import POLICY_PATH
from deployments.config import AppArgs
from deployments.ingress import Ingress
from specdec.policy import PolicyConfig

# Dict-typed fields that Ray validates against a model later (or not at all).
_DICT_FIELDS: dict[str, type[BaseModel]] = {
    "ray_actor_options": RayActorOptionsSchema,
    "autoscaling_config": AutoscalingConfig,
    "policy": AutoscalingPolicy,
    "autoscaling_policy": AutoscalingPolicy,
}
_FREE_FORM = {"args", "user_config", "runtime_env", "resources", "logging_config", "policy_kwargs"}
_OUR_DEPLOYMENTS = {"SpecRouter", "Ingress"}  # what deployments.app builds


def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (Optional[M], List[M], M), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_of(arg)) is not None:
            return found
    return None


def unknown_keys(data, model: type[BaseModel], path: str = "") -> list[str]:
    problems = []
    if isinstance(data, list):
        for i, item in enumerate(data):
            problems += unknown_keys(item, model, f"{path}[{i}]")
        return problems
    if not isinstance(data, dict):
        return problems
    fields = model.model_fields
    aliases = {f.alias for f in fields.values() if f.alias}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields and key not in aliases:
            problems.append(f"{where}: unknown key (Ray would ignore it silently)")
            continue
        if key in _FREE_FORM:
            continue
        sub = _DICT_FIELDS.get(key) or _model_of(fields[key].annotation)
        if sub is not None:
            problems += unknown_keys(value, sub, where)
    return problems


def _errors(exc: ValidationError) -> list[str]:
    return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"] for e in exc.errors()]


def lint_policy(policy: dict, where: str) -> list[str]:
    """A custom autoscaling policy: its import path resolves and its kwargs fit."""
    from ray._common.utils import import_attr

    if not isinstance(policy, dict):
        return [f"{where}: must be a mapping"]
    path = policy.get("policy_function")
    kwargs = policy.get("policy_kwargs") or {}
    if path is None:
        return []  # Ray's default policy
    try:
        target = import_attr(path)
    except Exception as exc:  # ModuleNotFoundError, AttributeError, ValueError (bad path)
        return [f"{where}.policy_function: {path!r} does not import ({type(exc).__name__}: {exc})"]
    if not inspect.isclass(target):
        return [f"{where}.policy_kwargs: ignored by Ray for a function policy"] if kwargs else []
    try:
        json.dumps(kwargs)
        inspect.signature(target).bind(**kwargs)
        target(**kwargs)
    except Exception as exc:  # unknown kwarg (TypeError), bad value (ValueError), not JSON
        return [f"{where}.policy_kwargs: {type(exc).__name__}: {exc}"]
    return []


def _lint_autoscaling(autoscaling: dict, where: str) -> list[str]:
    if not isinstance(autoscaling, dict):
        return []
    problems = lint_policy(autoscaling["policy"], f"{where}.policy") if "policy" in autoscaling else []
    try:  # the values Ray's schema lets through as a plain dict
        AutoscalingConfig.model_validate({k: v for k, v in autoscaling.items() if k != "policy"})
    except ValidationError as exc:
        problems += [f"{where}: {e}" for e in _errors(exc)]
    return problems


def _without_policies(config: dict) -> dict:
    """The config minus custom policies, so Ray's schema does not try to import them."""
    config = copy.deepcopy(config)
    for app in config.get("applications") or []:
        if isinstance(app, dict):
            app.pop("autoscaling_policy", None)
            for dep in app.get("deployments") or []:
                if isinstance(dep, dict) and isinstance(dep.get("autoscaling_config"), dict):
                    dep["autoscaling_config"].pop("policy", None)
    return config


def _lint_router_capacity(app: dict, dep: dict, where: str) -> list[str]:
    """SpecRouter's request limit against its loop threads and the policy's idea of it."""
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except (ValidationError, ValueError):
        return []  # reported with the args
    limit = dep.get("max_ongoing_requests", args.max_concurrent_requests)
    if not isinstance(limit, int):
        return []  # the schema reports it
    problems = []
    if limit > args.max_concurrent_requests:
        problems.append(
            f"{where}.max_ongoing_requests: {limit} > args.max_concurrent_requests "
            f"({args.max_concurrent_requests}): requests beyond that wait inside the replica, "
            "invisible to backpressure"
        )
    policy = (dep.get("autoscaling_config") or {}).get("policy") or {}
    per_unit = (policy.get("policy_kwargs") or {}).get("max_requests_per_unit")
    if policy.get("policy_function") == POLICY_PATH and isinstance(per_unit, (int, float)) and per_unit > limit:
        problems.append(
            f"{where}.autoscaling_config.policy.policy_kwargs.max_requests_per_unit: {per_unit} > "
            f"the unit's max_ongoing_requests ({limit}): the policy would count on capacity "
            "the unit refuses"
        )
    return problems


def _replicas(dep: dict) -> int:
    """The fewest replicas a deployment entry runs (its autoscaling minimum, at least 1)."""
    autoscaling = dep.get("autoscaling_config")
    if isinstance(autoscaling, dict):
        return max(1, autoscaling.get("min_replicas", 1))
    n = dep.get("num_replicas", 1)
    return n if isinstance(n, int) else 1


def _lint_ingress_limit(app: dict, where: str) -> list[str]:
    """The ingress must let through at least as many requests as the units take."""
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except (ValidationError, ValueError):
        return []  # reported with the args
    deps = {d.get("name"): d for d in app.get("deployments") or [] if isinstance(d, dict)}
    ingress, router = deps.get("Ingress", {}), deps.get("SpecRouter", {})
    per_ingress = ingress.get("max_ongoing_requests", Ingress.max_ongoing_requests)
    try:
        admitted = per_ingress * _replicas(ingress)
        taken = router.get("max_ongoing_requests", args.max_concurrent_requests) * _replicas(router)
        if admitted >= taken:
            return []
    except TypeError:
        return []  # a value of the wrong type: the schema reports it
    origin = "" if "max_ongoing_requests" in ingress else " (Ray's default)"
    return [
        f"{where}: Ingress max_ongoing_requests {per_ingress}{origin} lets {admitted} requests "
        f"through to SpecRouter units that take {taken}: the rest wait at the proxy, unbounded, "
        "where SpecRouter's max_queued_requests never applies; set Ingress max_ongoing_requests"
    ]


def lint_config(config) -> list[str]:
    """Every problem in a Serve config (the parsed YAML); an empty list means it is clean."""
    if not isinstance(config, dict):
        return ["not a Serve config: the top level must be a mapping"]
    problems = unknown_keys(config, ServeDeploySchema)
    try:
        ServeDeploySchema.model_validate(_without_policies(config))
    except ValidationError as exc:
        problems += [f"schema: {e}" for e in _errors(exc)]
    except Exception as exc:  # Ray's validators raise more than ValidationError
        problems.append(f"schema: {type(exc).__name__}: {exc}")
    for i, app in enumerate(config.get("applications") or []):
        if not isinstance(app, dict):
            continue
        if isinstance(app.get("autoscaling_policy"), dict):
            problems += lint_policy(app["autoscaling_policy"], f"applications[{i}].autoscaling_policy")
        ours = str(app.get("import_path", "")).startswith("deployments.app:")
        for j, dep in enumerate(app.get("deployments") or []):
            if not isinstance(dep, dict):
                continue
            where = f"applications[{i}].deployments[{j}]"
            if "autoscaling_config" in dep:
                problems += _lint_autoscaling(dep["autoscaling_config"], f"{where}.autoscaling_config")
            if ours and dep.get("name") not in _OUR_DEPLOYMENTS:
                problems.append(f"{where}.name: {dep.get('name')!r} is not one of {sorted(_OUR_DEPLOYMENTS)}")
            if ours and dep.get("name") == "SpecRouter":
                problems += _lint_router_capacity(app, dep, where)
            if dep.get("name") == "SpecRouter" and "user_config" in dep:
                try:
                    PolicyConfig.model_validate(dep["user_config"] or {})
                except ValidationError as exc:
                    problems += [f"{where}.user_config.{e}" for e in _errors(exc)]
        if ours:
            problems += _lint_ingress_limit(app, f"applications[{i}].deployments")
            try:
                AppArgs.model_validate(app.get("args") or {})
            except ValidationError as exc:
                problems += [f"applications[{i}].args.{e}" for e in _errors(exc)]
            except ValueError as exc:
                problems.append(f"applications[{i}].args: {exc}")
    return problems


def lint_rayservice(manifest: dict) -> list[str]:
    """A KubeRay RayService: its ``serveConfigV2`` is a Serve config in a string."""
    import ray

    spec = manifest.get("spec") or {}
    problems = []
    if manifest.get("apiVersion") != "ray.io/v1":
        problems.append(f"apiVersion: {manifest.get('apiVersion')!r}, expected 'ray.io/v1'")
    version = (spec.get("rayClusterConfig") or {}).get("rayVersion")
    if version != ray.__version__:
        problems.append(f"spec.rayClusterConfig.rayVersion: {version!r}, but the project pins ray {ray.__version__}")
    text = spec.get("serveConfigV2")
    if not isinstance(text, str):
        return problems + ["spec.serveConfigV2: missing (a YAML string)"]
    try:
        serve_config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return problems + [f"spec.serveConfigV2: not YAML: {exc}"]
    return problems + [f"spec.serveConfigV2: {p}" for p in lint_config(serve_config)]


def lint_cluster_launcher(config: dict) -> list[str]:
    """A ``ray up`` cluster config, against Ray's own launcher JSON schema."""
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or 'top level'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(config)
    ]
    types = config.get("available_node_types") or {}
    if config.get("head_node_type") not in types:
        problems.append(f"head_node_type: {config.get('head_node_type')!r} is not in available_node_types")
    return problems


def lint_file(path: str | Path) -> list[str]:
    """Lint any of the project's YAML files, by what it is."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"cannot read: {exc}"]
    if isinstance(data, dict) and data.get("kind") == "RayService":
        return lint_rayservice(data)
    if isinstance(data, dict) and "provider" in data and "available_node_types" in data:
        return lint_cluster_launcher(data)
    return lint_config(data)


def lint_serve_config(path: str | Path) -> list[str]:
    """Every problem found in a Serve config file; an empty list means it is clean."""
    return lint_config(yaml.safe_load(Path(path).read_text()))
