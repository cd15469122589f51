"""``build_app(args)``: the application ``serve run serve_config.yaml`` imports."""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs, resolve_models
from deployments.ingress import Ingress
from deployments.router import SpecRouter


def unit_bundles(args: AppArgs) -> list[dict]:
    """Placement-group bundles of one unit: router, then (actors mode) target and draft."""
    res = args.resources
    if args.colocation == "in_process":
        # The models live in the router: it gets the target's share of the node.
        return [{"CPU": res.target_cpus, **({"GPU": res.target_gpus} if res.target_gpus else {})}]
    bundles = [{"CPU": res.router_cpus}]
    bundles.append({"CPU": res.target_cpus, **({"GPU": res.target_gpus} if res.target_gpus else {})})
    if args.models.draft:
        bundles.append({"CPU": res.draft_cpus, **({"GPU": res.draft_gpus} if res.draft_gpus else {})})
    return bundles


def build_app(args: dict) -> Application:
    """Validate ``args`` (unknown keys are an error) and bind Ingress -> SpecRouter."""
    parsed = AppArgs.model_validate(args)
    parsed = parsed.model_copy(update={"models": resolve_models(parsed.models)})
    bundles = unit_bundles(parsed)
    unit = {k: v for k, v in parsed.model_dump().items() if k in AppArgs.model_fields and k != "ingress_cpus"}
    first = bundles[0]
    router = SpecRouter.options(
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": first["CPU"], "num_gpus": first.get("GPU", 0)},
        max_ongoing_requests=parsed.max_concurrent_requests,
    ).bind(unit)
    return Ingress.options(ray_actor_options={"num_cpus": parsed.ingress_cpus}).bind(
        router, parsed.models.name
    )
