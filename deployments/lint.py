"""Lint a Serve config: Ray's schema, our builder's args, and keys Ray would drop silently.

Ray 2.60 validates a config with pydantic models that ignore unknown keys, so a misspelled
``num_replicaz`` disappears without a word. ``lint_serve_config`` walks the YAML against the
schema models and reports every key no model declares.
"""

from __future__ import annotations

import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import RayActorOptionsSchema, ServeDeploySchema

from deployments.config import AppArgs
from specdec.policy import PolicyConfig

# Dict-typed fields that Ray validates against a model later (or not at all).
_DICT_FIELDS: dict[str, type[BaseModel]] = {
    "ray_actor_options": RayActorOptionsSchema,
    "autoscaling_config": AutoscalingConfig,
}
_FREE_FORM = {"args", "user_config", "runtime_env", "resources", "logging_config", "policy"}


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


def lint_serve_config(path: str | Path) -> list[str]:
    """Every problem found in a Serve config file; an empty list means it is clean."""
    config = yaml.safe_load(Path(path).read_text())
    problems = unknown_keys(config, ServeDeploySchema)
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        problems += [f"schema: {e['loc']}: {e['msg']}" for e in exc.errors()]
    for i, app in enumerate(config.get("applications") or []):
        for j, dep in enumerate(app.get("deployments") or []):
            if dep.get("name") == "SpecRouter" and "user_config" in dep:
                try:
                    PolicyConfig.model_validate(dep["user_config"] or {})
                except ValidationError as exc:
                    problems.append(f"applications[{i}].deployments[{j}].user_config: {exc}")
        if str(app.get("import_path", "")).startswith("deployments.app:"):
            try:
                AppArgs.model_validate(app.get("args") or {})
            except (ValidationError, ValueError) as exc:
                problems.append(f"applications[{i}].args: {exc}")
    return problems
