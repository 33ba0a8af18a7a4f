"""The objectives a run can optimize, each declared by an `ObjectiveSpec` in its module here (SFT's
token loss in sft.py, DPO's pair loss in dpo.py, GRPO's online RL in grpo.py, distillation's divergence
in distill.py), and how a config finds its own."""

from __future__ import annotations

from dtrain.config import Config, ConfigError
from dtrain.objectives import distill, dpo, grpo, sft
from dtrain.objectives.base import Context, Objective, ObjectiveSpec, StepFigures

OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.name: spec for spec in (sft.SPEC, dpo.SPEC, grpo.SPEC, distill.SPEC)
}

__all__ = ["OBJECTIVES", "Context", "Objective", "ObjectiveSpec", "StepFigures", "build_objective"]


def objective_of(config: Config) -> ObjectiveSpec:
    """The objective a config trains: the one whose schema it is (each entry point composes its own);
    a schema of no objective (the planner's, which holds every group) takes the first objective that
    trains on its data's format."""
    for spec in OBJECTIVES.values():
        if type(config) is spec.schema:
            return spec
    formats = {source.format for source in config.data.sources()}
    return next((spec for spec in OBJECTIVES.values() if formats <= set(spec.formats)), sft.SPEC)


def check_objective(config: Config, spec: ObjectiveSpec) -> None:
    """The data are in `spec`'s formats (a format of another objective's names its entry point), and
    its own group's checks pass (resolving its `auto` values)."""
    for source in config.data.sources():
        if source.format in spec.formats:
            continue
        key = source.key("format")
        owner = next((other for other in OBJECTIVES.values() if source.format in other.formats), None)
        allowed = " or ".join(spec.formats)
        hint = f"; {source.format} data train with dtrain.{owner.name}" if owner else ""
        raise ConfigError(f"{key}={source.format}: dtrain.{spec.name} trains on {key}={allowed}{hint}")
    spec.check(config)


def build_objective(context: Context) -> Objective:
    """The objective `context.config` trains (objective_of), built for `context`."""
    return objective_of(context.config).build(context)
