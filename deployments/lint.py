"""Lint the project's YAML: Serve configs, the KubeRay RayService, the Ray cluster launcher.

Ray 2.60 validates a Serve config with pydantic models that ignore unknown keys, so a
misspelled ``num_replicaz`` disappears without a word; ``autoscaling_config`` is typed
``Dict | AutoscalingConfig``, so an invalid one (``min_replicas`` > ``max_replicas``, a
negative delay) passes the schema as a plain dict; and a custom autoscaling policy that does
not import stops the whole parse with an ImportError. ``lint_config`` reports all of these,
one line per problem, plus what our builder (``deployments.app``) would refuse or silently
do differently, and for our app the admission rules: a full unit must be able to answer
503/429 + Retry-After (finite queues; an Ingress that admits more than the units hold), and
``http_options.request_timeout_s`` must be set. ``specdec check-config FILE...`` runs it.
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
from deployments.config import INGRESS_MAX_ONGOING, INGRESS_MAX_QUEUED, UNIT_MAX_QUEUED, AppArgs, router_name
from specdec.policy import PolicyConfig

# Dict-typed fields that Ray validates against a model later (or not at all).
_DICT_FIELDS: dict[str, type[BaseModel]] = {
    "ray_actor_options": RayActorOptionsSchema,
    "autoscaling_config": AutoscalingConfig,
    "policy": AutoscalingPolicy,
    "autoscaling_policy": AutoscalingPolicy,
}
_FREE_FORM = {"args", "user_config", "runtime_env", "resources", "logging_config", "policy_kwargs"}
def _our_deployments(app: dict) -> list[str]:
    """What deployments.app builds for ``app``: the Ingress and one SpecRouter per unit, or
    (``ingress: in_unit``) the unit's SpecRouter alone."""
    if _in_unit(app):
        return [router_name(0)]
    units = (app.get("args") or {}).get("units") or []
    return ["Ingress", *(router_name(i) for i in range(1 + (len(units) if isinstance(units, list) else 0)))]


def _in_unit(app: dict) -> bool:
    return (app.get("args") or {}).get("ingress") == "in_unit"


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
    if args.ingress == "in_unit":
        return _lint_in_unit_admission(args, dep, where)
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
    return problems + _policy_per_unit(dep, limit, "the unit's max_ongoing_requests", where)


def _policy_per_unit(dep: dict, limit: int, what: str, where: str) -> list[str]:
    """The speculation-aware policy's ``max_requests_per_unit`` may not exceed what a unit takes."""
    policy = (dep.get("autoscaling_config") or {}).get("policy") or {}
    per_unit = (policy.get("policy_kwargs") or {}).get("max_requests_per_unit")
    if policy.get("policy_function") == POLICY_PATH and isinstance(per_unit, (int, float)) and per_unit > limit:
        return [
            f"{where}.autoscaling_config.policy.policy_kwargs.max_requests_per_unit: {per_unit} > "
            f"{what} ({limit}): the policy would count on capacity the unit refuses"
        ]
    return []


def _lint_in_unit_admission(args: AppArgs, dep: dict, where: str) -> list[str]:
    """``ingress: in_unit``: the SpecRouter replica takes HTTP (every API call is one of its
    ``max_ongoing_requests``) and refuses generations past ``max_concurrent_requests`` +
    ``UNIT_MAX_QUEUED`` itself; that 503 + Retry-After must be reachable, and the proxy's queue
    before it bounded, with a Retry-After of its own."""
    admitted = dep.get("max_ongoing_requests", INGRESS_MAX_ONGOING)
    queued = dep.get("max_queued_requests", INGRESS_MAX_QUEUED)
    if not isinstance(admitted, int) or not isinstance(queued, int):
        return []  # the schema reports it
    held = args.max_concurrent_requests + UNIT_MAX_QUEUED
    problems = []
    if admitted <= held:
        problems.append(
            f"{where}.max_ongoing_requests: {admitted} <= the {held} generations the unit holds "
            f"(max_concurrent_requests {args.max_concurrent_requests} + {UNIT_MAX_QUEUED} waiting): its own "
            f"503 + Retry-After is unreachable and the excess waits at the proxy; set it above {held}"
        )
    problems += _policy_per_unit(dep, held, "the generations the unit holds", where)
    return problems + _proxy_queue(where, router_name(0), dep, queued)


def _max_replicas(dep: dict) -> int:
    """The most replicas a deployment entry runs: its autoscaling maximum, else num_replicas."""
    autoscaling = dep.get("autoscaling_config")
    if dep.get("num_replicas") == "auto":  # Serve's default autoscaling, overridden key by key
        default = AutoscalingConfig.default().max_replicas
        return autoscaling.get("max_replicas", default) if isinstance(autoscaling, dict) else default
    if isinstance(autoscaling, dict):
        return autoscaling.get("max_replicas", AutoscalingConfig().max_replicas)
    n = dep.get("num_replicas", 1)
    return n if isinstance(n, int) else 1


def _unbounded_queues(at, router: dict, ingress: dict, *, slots: int, ongoing: int, queued: int,
                      ingress_queued: int) -> list[str]:
    """SpecRouter's and the Ingress's queues must be bounded, and a refusal must say when to retry."""
    problems = []
    if queued == -1:
        problems.append(
            f"{at('SpecRouter')}.max_queued_requests: {'-1' if 'max_queued_requests' in router else 'not set'}"
            f" (no limit): past the units' {slots} slots requests queue at each Ingress "
            "replica without end and never get 503/429 + Retry-After; set SpecRouter "
            f"max_queued_requests (e.g. {4 * ongoing}: four turns of a unit's slots)"
        )
    return problems + _proxy_queue(at("Ingress"), "Ingress", ingress, ingress_queued)


def _proxy_queue(where: str, name: str, entry: dict, queued: int) -> list[str]:
    """The queue at each proxy before the deployment ``name`` that takes HTTP: bounded, and its
    refusal with a Retry-After."""
    if queued == -1:
        return [
            f"{where}.max_queued_requests: {'-1' if 'max_queued_requests' in entry else 'not set'}"
            f" (no limit): once every {name} replica holds max_ongoing_requests, requests wait at "
            f"each proxy without end; set {name} max_queued_requests (and backpressure_config."
            "retry_after_s) so the proxy answers 503/429 + Retry-After"
        ]
    if "backpressure_config" in entry and (entry["backpressure_config"] or {}).get("retry_after_s") is None:
        return [
            f"{where}.backpressure_config.retry_after_s: not set: the proxy refuses past "
            f"{name} max_queued_requests without a Retry-After header; set it (seconds)"
        ]
    return []


def _lint_admission(app: dict, where: str) -> list[str]:
    """Whether a full unit can answer 503/429 + Retry-After, and every queue is bounded.

    SpecRouter's ``max_queued_requests`` is counted per caller (each Ingress replica's handle;
    ray/serve/_private/router.py, ``wrap_request_assignment``), its ``max_ongoing_requests`` per
    router replica across callers. So one Ingress replica can have at most
    ``max_ongoing * max_replicas + max_queued`` requests held by the units; only its next one
    gets BackPressureError (then 503/429 + Retry-After). An Ingress replica that admits no more
    than that never reaches it: the excess waits at the proxy instead, in the Ingress's queue.
    """
    try:
        args = AppArgs.model_validate(app.get("args") or {})
    except (ValidationError, ValueError):
        return []  # reported with the args
    if args.ingress == "in_unit":
        return []  # one deployment: its entry's check (_lint_router_capacity)
    entries = app.get("deployments") or []
    index = {d.get("name"): i for i, d in enumerate(entries) if isinstance(d, dict)}

    def at(name: str) -> str:
        return f"{where}[{index[name]}]" if name in index else f"{where} ({name}: no entry)"

    ingress = entries[index["Ingress"]] if "Ingress" in index else {}
    router = entries[index["SpecRouter"]] if "SpecRouter" in index else {}
    ongoing = router.get("max_ongoing_requests", args.max_concurrent_requests)
    replicas = _max_replicas(router)
    queued = router.get("max_queued_requests", UNIT_MAX_QUEUED)
    if "max_ongoing_requests" in ingress:
        admitted, origin = ingress["max_ongoing_requests"], "set here"
    else:
        admitted, origin = INGRESS_MAX_ONGOING, "the builder's default, deployments/config.py"
    ingress_queued = ingress.get("max_queued_requests", INGRESS_MAX_QUEUED)
    if not all(isinstance(v, int) for v in (ongoing, replicas, queued, admitted, ingress_queued)):
        return []  # a value of the wrong type: the schema reports it
    problems = _unbounded_queues(at, router, ingress, slots=ongoing * replicas, ongoing=ongoing,
                                 queued=queued, ingress_queued=ingress_queued)
    held = ongoing * replicas + queued
    if queued != -1 and admitted <= held:
        scale = f" x {replicas} replica" + ("s (max_replicas)" if replicas > 1 else "")
        problems.append(
            f"{at('Ingress')}.max_ongoing_requests: {admitted} ({origin}) <= the {held} requests "
            f"SpecRouter holds per caller ({ongoing} running{scale} + {queued} queued): "
            "backpressure is unreachable, a full unit never answers 503/429 + Retry-After and the "
            f"excess waits at the proxy instead; set Ingress max_ongoing_requests above {held} "
            "(or lower SpecRouter max_queued_requests)"
        )
    return problems


def _lint_http_options(config: dict) -> list[str]:
    """Serve's end-to-end request timeout (ray/serve/_private/proxy.py, ``send_request_to_replica``)."""
    http = config.get("http_options")
    timeout = http.get("request_timeout_s") if isinstance(http, dict) else None
    if timeout is None:
        return [(
            "http_options.request_timeout_s: not set: Serve puts no limit on a request, a stuck "
            "or endless stream holds its slots forever; set it (seconds, queueing and the whole "
            "stream included)"
        )]
    if isinstance(timeout, (int, float)) and timeout <= 0:
        return [(
            f"http_options.request_timeout_s: {timeout}: Serve reads a negative value as no "
            "timeout and 0 as an immediate 408; set it above 0"
        )]
    return []


def lint_config(config) -> list[str]:
    """Every problem in a Serve config (the parsed YAML); an empty list means it is clean."""
    if not isinstance(config, dict):
        return ["not a Serve config: the top level must be a mapping"]
    problems = unknown_keys(config, ServeDeploySchema)
    apps = [a for a in config.get("applications") or [] if isinstance(a, dict)]
    if any(str(a.get("import_path", "")).startswith("deployments.app:") for a in apps):
        problems += _lint_http_options(config)
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
            if ours and dep.get("name") not in _our_deployments(app):
                problems.append(f"{where}.name: {dep.get('name')!r} is not one of {_our_deployments(app)}")
            if ours and dep.get("name") == "SpecRouter":
                problems += _lint_router_capacity(app, dep, where)
            if str(dep.get("name", "")).startswith("SpecRouter") and "user_config" in dep:
                try:
                    PolicyConfig.model_validate(dep["user_config"] or {})
                except ValidationError as exc:
                    problems += [f"{where}.user_config.{e}" for e in _errors(exc)]
        if ours:
            problems += _lint_admission(app, f"applications[{i}].deployments")
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
