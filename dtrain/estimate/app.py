"""`python -m dtrain.estimate [+experiment=NAME] estimate.world_size=N [key=value ...]`.

The same Hydra composition as dtrain.sft (conf/, experiments, overrides), plus the `estimate`
group; it writes nothing (no run folder, no Hydra log) and prints the plan on stdout. `compose`
gives scripts and tests the same config without the command line.
"""

from __future__ import annotations

import json
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from dtrain.checks import check_estimate
from dtrain.config import ConfigError, PlanConfig
from dtrain.estimate.planner import plan, suggest
from dtrain.estimate.report import to_json, to_table
from dtrain.hydra_glue import CONF, fail, fit_embedded_default, register, with_embedded_defaults
from dtrain.objectives.sft import SPEC as SFT


def use_plan_schema() -> None:
    """PlanConfig as the schema Hydra composes (again at each compose: ConfigStore is one per process,
    and importing another entry point, dtrain.sft or dtrain.dpo, replaces it). Plans are for GPUs:
    the embedded default's precision is what it would be on CUDA."""
    register(PlanConfig, lambda: "bf16")


use_plan_schema()

# Nothing to write: run and sweep folders are the current one, with no .hydra/ and no log files
# (a --multirun sweep still leaves Hydra's multirun.yaml there).
QUIET_HYDRA = [
    "hydra.sweep.dir=.",
    "hydra.sweep.subdir=.",
    "hydra.run.dir=.",
    "hydra.output_subdir=null",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
]


def compose(overrides: list[str]) -> PlanConfig:
    """The config `python -m dtrain.estimate OVERRIDES` plans, checked the same way."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = with_embedded_defaults(overrides, SFT.embedded)
    use_plan_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
        return to_plan_config(cfg, overrides)


def to_plan_config(cfg: DictConfig, overrides: list[str]) -> PlanConfig:
    """The checked config; the embedded default fitted to estimate.world_size, as a run fits it."""
    world_size = OmegaConf.select(cfg, "estimate.world_size", throw_on_missing=False)
    if isinstance(world_size, int) and world_size > 0:
        fit_embedded_default(cfg, world_size, overrides, SFT.embedded)
    try:
        config = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as error:  # estimate.world_size has no default
        raise ConfigError(f"{error.full_key}: required (e.g. {error.full_key}=8)") from error
    assert isinstance(config, PlanConfig), type(config)
    check_estimate(config.estimate)
    return config


@hydra.main(version_base=None, config_path=str(CONF), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    try:
        config = to_plan_config(cfg, list(HydraConfig.get().overrides.task))
        settings = config.estimate
        result = plan(config, settings.world_size)
        budget = round(settings.gpu_memory_gib * 2**30)
        fits = result.step.peak <= budget
        suggestions = [] if fits or not settings.suggestions else suggest(config, settings.world_size, budget)
    except ConfigError as error:
        fail(str(error))
    if settings.format == "json":
        print(
            json.dumps(to_json(result, settings.gpu_memory_gib, suggestions, settings.top_modules), indent=1)
        )
    else:
        print(to_table(result, settings.gpu_memory_gib, suggestions, settings.top_modules))


def main() -> None:
    use_plan_schema()
    sys.argv[1:] = with_embedded_defaults(sys.argv[1:], SFT.embedded) + QUIET_HYDRA
    hydra_main()
