"""A generation's rewards → advantages and TRL's reward and length metrics (dtrain.grpo), computed on
the whole generation (every rank holds it: groups whole whatever the mesh), in float32 with TRL 1.16's
own tensor operations, so the same rewards give bit for bit TRL's advantages.

- `sum_then_normalize` (TRL's default): r = nansum_k(w_k · r_k) (a function's None drops its term; a
  completion every function skipped is NaN, left out of the group statistics, advantage 0);
  A = (r − group mean) / (std + 1e-4), std the unbiased NaN-aware std of the group (`group`) or of
  the whole generation (`batch`); `none`: A = r − group mean.
- `normalize_then_sum`: each function normalised per group, weighted, summed, then normalised over the
  whole generation.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.config import GRPOConfig


def nanstd(tensor: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased std ignoring NaNs (Bessel over the values present; NaN for fewer than two)."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    variance = variance * correction
    if not keepdim:
        variance = variance.squeeze(dim) if dim is not None else variance.reshape(())
    return torch.sqrt(variance)


def advantages(per_func: torch.Tensor, settings: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [n], is_std_zero [n]) of a generation's rewards `per_func` [n, functions] (NaN:
    skipped), n a multiple of G, each prompt's G completions consecutive."""
    weights = reward_weights(settings, per_func.shape[1])
    group = settings.num_generations
    unscorable = torch.isnan(per_func).all(dim=1)
    if settings.multi_objective_aggregation == "normalize_then_sum":
        grouped = per_func.view(-1, group, per_func.shape[1])
        normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
            nanstd(grouped, dim=1, keepdim=True) + 1e-4
        )
        rewards = (normalised.view(-1, per_func.shape[1]) * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards)
        result = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        rewards = weighted_rewards(per_func, weights)
        mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
        if settings.scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards)
        else:  # group, and none for the zero-std figure only
            std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
        result = rewards - mean
        if settings.scale_rewards != "none":
            result = result / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(result, nan=0.0), is_std_zero


def reward_weights(settings: GRPOConfig, functions: int) -> torch.Tensor:
    weights = settings.reward_weights if settings.reward_weights is not None else [1.0] * functions
    return torch.tensor(weights, dtype=torch.float32)


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[n]: each completion's weighted sum of its rewards (NaN where every function skipped it)."""
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def generation_metrics(
    per_func: torch.Tensor,
    names: list[str],
    settings: GRPOConfig,
    is_std_zero: torch.Tensor,
    lengths: list[int],
    truncated: list[bool],
) -> dict[str, Any]:
    """TRL's metrics of one generation: reward, reward_std (over the whole generation), each function's
    mean and std, frac_reward_zero_std, and the completion lengths (every completion, truncated or
    masked ones included) with those of the completions that ended with EOS."""
    rewards = weighted_rewards(per_func, reward_weights(settings, per_func.shape[1]))
    metrics: dict[str, Any] = {}
    for index, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, index]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, index]).item()
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    length = torch.tensor(lengths, dtype=torch.float32)
    ended = torch.tensor(truncated, dtype=torch.bool)
    metrics["completions/mean_length"] = length.mean().item()
    metrics["completions/min_length"] = length.min().item()
    metrics["completions/max_length"] = length.max().item()
    metrics["completions/clipped_ratio"] = ended.float().mean().item()
    terminated = length[~ended] if (~ended).any() else torch.zeros(1)
    metrics["completions/mean_terminated_length"] = terminated.mean().item()
    metrics["completions/min_terminated_length"] = terminated.min().item()
    metrics["completions/max_terminated_length"] = terminated.max().item()
    return metrics
