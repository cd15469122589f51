"""``build_app(args)``: the application ``serve run serve_config.yaml`` imports."""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import BackpressureConfig

from deployments.config import (
    INGRESS_MAX_ONGOING, INGRESS_MAX_QUEUED, RETRY_AFTER_S, UNIT_HEALTH_CHECK_TIMEOUT_S, UNIT_MAX_QUEUED, AppArgs,
    UnitArgs, resolve_models,
    router_name,
)
from deployments.ingress import Ingress
from deployments.router import SpecRouter
from deployments.unit_ingress import UnitIngress

APP_ONLY = set(AppArgs.model_fields) - set(UnitArgs.model_fields)  # the ingress's and the application's


def _admission(max_queued: int) -> dict:
    """A bounded queue, and what a refused request hears: 503 with Retry-After."""
    return {"max_queued_requests": max_queued,
            "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S)}


def unit_bundles(args: UnitArgs) -> list[dict]:
    """Placement-group bundles of one unit: router, then (actors mode) target and draft."""
    res = args.resources

    def bundle(cpus: float, gpus: float) -> dict:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    if args.colocation == "in_process":  # the models live in the router
        return [bundle(res.target_cpus, res.target_gpus)]
    bundles = [bundle(res.router_cpus, 0), bundle(res.target_cpus, res.target_gpus)]
    if args.models.draft:
        bundles.append(bundle(res.draft_cpus, res.draft_gpus))
    return bundles


def build_unit(args: dict | UnitArgs, name: str = "SpecRouter", **options) -> Application:
    """The SpecRouter deployment (one replica = one co-located unit), bound to its args.

    ``options`` are extra deployment options (``num_replicas``, ...); serve_config.yaml's
    ``deployments:`` entries override them as usual.
    """
    unit = _resolved(args)
    return SpecRouter.options(**_unit_options(unit, name, unit.max_concurrent_requests, UNIT_MAX_QUEUED, options)
                              ).bind(unit.model_dump())


def build_unit_ingress(args: AppArgs, **options) -> Application:
    """``ingress: in_unit``: the unit's replicas serve the API themselves (``deployments.unit_ingress``).

    Its replicas take requests as an Ingress does (the proxy's queue, then 503 + Retry-After);
    the unit refuses generations past its own bound inside (``LocalUnit``)."""
    unit = _resolved(UnitArgs.model_validate(args.model_dump(exclude=APP_ONLY)))
    return UnitIngress.options(**_unit_options(unit, router_name(0), INGRESS_MAX_ONGOING, INGRESS_MAX_QUEUED, options)
                              ).bind(unit.model_dump(), args.api_keys, args.limits.model_dump())


def _resolved(args: dict | UnitArgs) -> UnitArgs:
    unit = UnitArgs.model_validate(args if isinstance(args, dict) else args.model_dump())
    return unit.model_copy(update={"models": resolve_models(unit.models)})


def _unit_options(unit: UnitArgs, name: str, ongoing: int, queued: int, options: dict) -> dict:
    """A unit deployment's options: its placement group, what it admits, ``options`` over them."""
    bundles = unit_bundles(unit)
    return dict(
        name=name,
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": bundles[0]["CPU"], "num_gpus": bundles[0].get("GPU", 0)},
        max_ongoing_requests=ongoing,
        **{**_admission(queued), "health_check_timeout_s": UNIT_HEALTH_CHECK_TIMEOUT_S, **options},
    )


def build_app(args: dict) -> Application:
    """The ``import_path`` builder: Serve calls it with the config's ``args`` alone."""
    return bind_app(args)


def bind_app(args: dict, **router_options) -> Application:
    """Validate ``args`` (unknown keys are an error) and bind Ingress -> SpecRouter.

    ``router_options`` (``user_config``, ``num_replicas``, ...) are for Python callers;
    serve_config.yaml sets them under ``deployments:``.
    """
    parsed = AppArgs.model_validate(args)
    if parsed.ingress == "in_unit":
        return build_unit_ingress(parsed, **router_options)
    first = UnitArgs.model_validate(parsed.model_dump(exclude=APP_ONLY))
    routes = []
    for index, unit in enumerate([first, *parsed.units]):
        models = resolve_models(unit.models)
        router = build_unit(unit, router_name(index), **(router_options if index == 0 else {}))
        routes.append({"router": router, "names": models.names})
    # The ingress only forwards: the units' own limits (max_concurrent_requests, their queues)
    # must apply, not Serve's default of 5 requests per replica.
    return Ingress.options(
        ray_actor_options={"num_cpus": parsed.ingress_cpus}, max_ongoing_requests=INGRESS_MAX_ONGOING,
        **_admission(INGRESS_MAX_QUEUED),
    ).bind(routes, parsed.api_keys, parsed.limits.model_dump())
