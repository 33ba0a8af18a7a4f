"""dtrain.grpo's checks before launch (dtrain.objectives.grpo's SPEC.check): the grpo and rollout groups'
values, whole groups in a step, the reward functions importable, room for a completion in a row."""

from __future__ import annotations

from dtrain.config import Config, ConfigError, PlanConfig
from dtrain.objectives.grpo_loss import LOSS_TYPES
from dtrain.rewards import load

ENGINES = ("hf", "vllm", "file")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")


def check(config: Config) -> None:
    """grpo.* and rollout.*: values, the batch in whole groups, the reward functions importable."""
    settings, rollout, train = config.grpo, config.rollout, config.train
    group = settings.num_generations
    if group < 2:
        raise ConfigError(
            f"grpo.num_generations={group}: must be >= 2 (a group's advantages compare its completions)"
        )
    if train.global_batch_size % group:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} (completions) is not a multiple of "
            f"grpo.num_generations={group}: a step holds whole groups"
        )
    for key, value in (
        ("grpo.max_completion_length", settings.max_completion_length),
        ("grpo.num_iterations", settings.num_iterations),
        ("grpo.steps_per_generation", settings.steps_per_generation),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value}: must be >= 1")
    for key, value, allowed in (
        ("grpo.loss_type", settings.loss_type, LOSS_TYPES),
        ("grpo.importance_sampling_level", settings.importance_sampling_level, LEVELS),
        ("grpo.scale_rewards", settings.scale_rewards, SCALES),
        ("grpo.multi_objective_aggregation", settings.multi_objective_aggregation, AGGREGATIONS),
        ("grpo.vllm_importance_sampling_mode", settings.vllm_importance_sampling_mode, IS_MODES),
        ("rollout.engine", rollout.engine, ENGINES),
    ):
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(allowed)}")
    if not settings.temperature > 0:
        raise ConfigError(f"grpo.temperature={settings.temperature}: must be > 0")
    if settings.beta < 0 or settings.epsilon < 0 or (settings.epsilon_high or 0) < 0:
        raise ConfigError("grpo.beta, grpo.epsilon and grpo.epsilon_high must be >= 0")
    if settings.delta is not None and not settings.delta > 1:
        raise ConfigError(f"grpo.delta={settings.delta}: must be > 1 (it caps the ratio above 1 + epsilon)")
    if not settings.reward_funcs:
        raise ConfigError("grpo.reward_funcs=[]: name at least one reward function")
    if settings.reward_weights is not None and len(settings.reward_weights) != len(settings.reward_funcs):
        raise ConfigError(
            f"grpo.reward_weights={list(settings.reward_weights)}: one weight per grpo.reward_funcs entry "
            f"({len(settings.reward_funcs)})"
        )
    load(settings.reward_funcs)  # a function that cannot be imported fails now, on every rank
    if config.data.max_len <= settings.max_completion_length:
        raise ConfigError(
            f"data.max_len={config.data.max_len} must exceed grpo.max_completion_length="
            f"{settings.max_completion_length}: a row holds a prompt and its whole completion"
        )
    if rollout.engine == "file" and not rollout.path:
        raise ConfigError(
            "rollout.engine=file: needs rollout.path (a JSONL of prompts and their completions)"
        )
    if rollout.engine == "vllm" and not isinstance(config, PlanConfig):  # a plan needs no vLLM, no GPU
        from dtrain.rollout import vllm

        vllm.check(rollout)
    if train.epochs is not None:
        raise ConfigError(
            f"train.epochs={train.epochs}: dtrain.grpo counts train.max_steps (unset train.epochs)"
        )
    if train.eval_every:
        raise ConfigError(f"train.eval_every={train.eval_every}: dtrain.grpo has no eval yet (set 0)")
    if config.parallel.loss_impl == "chunked":
        raise ConfigError("parallel.loss_impl=chunked: dtrain.grpo takes dense or fused (auto picks)")
    if config.moe.aux_scope != "global_batch":
        raise ConfigError(
            f"moe.aux_scope={config.moe.aux_scope}: dtrain.grpo defines the router's aux loss over the whole "
            "step (global_batch), so that the loss does not change with the accumulation"
        )
