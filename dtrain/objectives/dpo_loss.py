"""DPO's loss on the mesh (dtrain.dpo): each sequence's log-probability, the pair losses, and the
forward + loss + backward of a micro-batch of pairs (`micro_step`, which dtrain.objectives.dpo.PairLoss
runs, as dtrain.objectives.sft.TokenLoss runs dtrain.step.micro_step).

A sequence's log-probability is the sum of its completion tokens' log-probabilities (fp32), as
TRL's DPOTrainer sums them: per token from the vocabulary-sharded head without the full logits
(dtrain.fused_loss.fused_token_logps; `dense`: loss parallel's cross-entropy per token), summed per
sequence by each target's `sequence_index` (dtrain/data/pairs.py), and under context parallel the
cp ranks' partial sums all-reduced, with the identity as backward (each rank's tokens take the
gradient of the whole sum). The loss of a step is Σ over its pairs of ℓ_i divided by the step's pair
count over every dp rank (tp and cp ranks hold the same pairs), so it is the same on any mesh and
any accumulation; TRL averages over each micro-batch, which is the same when one micro-batch holds
the whole step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtrain.config import DPOConfig
from dtrain.fused_loss import fused_token_logps
from dtrain.loss import IGNORE, loss_context
from dtrain.parallel.router import RouterStats
from dtrain.step import final_hidden_states, model_inputs

# Per pair (rows of [pairs, 2]: chosen, rejected): TRL 1.16's formulas. `ratios`: the log-ratios
# policy − reference; `lengths`: the completions' token counts (ipo normalises by them).
Loss = Callable[[torch.Tensor, torch.Tensor, DPOConfig], torch.Tensor]


def _margin(ratios: torch.Tensor) -> torch.Tensor:
    return ratios[:, 0] - ratios[:, 1]


def _sigmoid(ratios: torch.Tensor, lengths: torch.Tensor, settings: DPOConfig) -> torch.Tensor:
    return -F.logsigmoid(settings.beta * _margin(ratios))


def _hinge(ratios: torch.Tensor, lengths: torch.Tensor, settings: DPOConfig) -> torch.Tensor:
    return torch.relu(1 - settings.beta * _margin(ratios))


def _ipo(ratios: torch.Tensor, lengths: torch.Tensor, settings: DPOConfig) -> torch.Tensor:
    per_token = ratios / lengths.clamp(min=1.0)
    return (_margin(per_token) - 1 / (2 * settings.beta)) ** 2


def _robust(ratios: torch.Tensor, lengths: torch.Tensor, settings: DPOConfig) -> torch.Tensor:
    smoothing, logits = settings.label_smoothing, settings.beta * _margin(ratios)
    clean = -(1 - smoothing) * F.logsigmoid(logits)
    flipped = -smoothing * F.logsigmoid(-logits)
    return (clean - flipped) / (1 - 2 * smoothing)


LOSSES: dict[str, Loss] = {"sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge, "robust": _robust}
# The figures summed over a step's pairs (and `nll`, over its chosen tokens), in this order.
FIGURES = ("loss", "nll", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
FIGURES += ("logps/chosen", "logps/rejected")


def loss_types(settings: DPOConfig) -> list[tuple[str, float]]:
    """dpo.loss_type with dpo.loss_weights: (name, weight) each."""
    names = [settings.loss_type] if isinstance(settings.loss_type, str) else list(settings.loss_type)
    weights = settings.loss_weights or [1.0] * len(names)
    return list(zip(names, weights, strict=True))


def pair_losses(
    settings: DPOConfig, logps: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """ℓ_i of each pair: the weighted sum of dpo.loss_type's losses ([pairs])."""
    ratios = logps - ref
    total = torch.zeros(len(logps), device=logps.device)
    for name, weight in loss_types(settings):
        total = total + weight * LOSSES[name](ratios, lengths.to(ratios.dtype), settings)
    return total


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: each rank's part of a sum gets the
    gradient of the whole."""

    @staticmethod
    def forward(ctx, tensor, group):  # noqa: ANN001, ANN205
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


def sequence_logps(
    model: torch.nn.Module, micro_batch: dict[str, Any], loss_impl: str, loss_chunk: int, cp: DeviceMesh
) -> torch.Tensor:
    """[pairs, 2]: each pair's chosen and rejected log-probability (fp32; inside loss_context)."""
    inputs, labels = model_inputs(model, micro_batch), micro_batch["labels"]
    if loss_impl == "fused":
        hidden, head = final_hidden_states(model, inputs)
        tokens = fused_token_logps(hidden, head.weight, labels, loss_chunk, model.config.vocab_size)
    else:  # dense: the model's own (vocabulary-sharded) logits
        logits = model(**inputs).logits
        losses = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
        )
        tokens = -(losses.to_local() if isinstance(losses, DTensor) else losses).view(labels.shape)
    # Each scored position into its sequence's sum, the others (log-prob 0) into a spare last slot:
    # static shapes (no boolean indexing), as the planner's fake tensors need.
    count = micro_batch["completion_tokens"].numel()
    index = micro_batch["sequence_index"].flatten()
    index = torch.where(index >= 0, index, count)
    sums = torch.zeros(count + 1, dtype=torch.float32, device=tokens.device)
    sums = sums.index_add(0, index, tokens.flatten())[:count]
    if cp.size() > 1:
        sums = _SumOverRanks.apply(sums, cp.get_group())
    return sums.view(-1, 2)


def micro_step(
    model: torch.nn.Module,
    micro_batch: dict[str, Any],
    pairs: torch.Tensor,
    chosen_tokens: torch.Tensor,
    settings: DPOConfig,
    cp: DeviceMesh,
    loss_parallel: bool,
    loss_impl: str = "fused",
    loss_chunk: int = 256,
    router: RouterStats | None = None,
) -> torch.Tensor:
    """Forward, DPO loss and backward of one micro-batch of pairs (its `ref_logps` set: the reference
    policy's [pairs, 2]); the loss divided by the step's `pairs` (and RPO's NLL by its
    `chosen_tokens`). Returns the micro-batch's FIGURES summed over its pairs, detached. `router`: as
    in dtrain.step.micro_step."""
    recorded = router.record(micro_batch) if router is not None else contextlib.nullcontext()
    with loss_context(loss_parallel), recorded:
        logps = sequence_logps(model, micro_batch, loss_impl, loss_chunk, cp)
        aux = router.aux_term() if router is not None else None
        ref = micro_batch["ref_logps"]
        losses = pair_losses(settings, logps, ref, micro_batch["completion_tokens"].view(-1, 2))
        total = losses.sum() / pairs
        if settings.sft_weight:
            total = total - settings.sft_weight * logps[:, 0].sum() / chosen_tokens
        (total if aux is None else total + aux).backward()
    nll = -logps.detach()[:, 0].double().sum()
    return figures(settings, losses.detach(), nll, logps.detach(), ref)


def figures(
    settings: DPOConfig, losses: torch.Tensor, nll: torch.Tensor, logps: torch.Tensor, ref: torch.Tensor
) -> torch.Tensor:
    """FIGURES summed over a micro-batch's pairs (TRL's metrics: rewards are β · log-ratios, an
    accurate pair's chosen reward strictly above its rejected one), each pair's fp32 value summed in
    fp64: exact, so a step whose every pair's loss is fp32's ln 2 logs exactly that."""
    rewards = settings.beta * (logps - ref)
    per_pair = torch.stack(
        [
            losses,
            torch.zeros_like(losses),
            rewards[:, 0],
            rewards[:, 1],
            (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
            rewards[:, 0] - rewards[:, 1],
            logps[:, 0],
            logps[:, 1],
        ],
        dim=1,
    )
    sums = per_pair.double().sum(0)
    sums[1] = nll.double()
    return sums
