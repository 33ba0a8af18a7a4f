"""GRPO's loss on the mesh (dtrain.grpo): the per-token log-probabilities of a micro-batch of
completions, TRL 1.16's per-token surrogate, and its forward + loss + backward (`micro_step`, which
dtrain.objectives.grpo.GRPO runs).

Per completion token t of completion i (advantage A_i; old, reference and sampling log-probs from the
generation, dtrain/data/prompts.py):

    r_t = exp(logp_t − old_t)          token level; GSPO: r_i = exp(Σ_t (logp_t − old_t) / n_i) for all t of i
    ℓ_t = −min(min(r_t, δ) · A_i, clip(r_t, 1 − ε, 1 + ε_high) · A_i)   (× the vLLM importance ratio)
        + β · k3_t · (r_t if use_bias_correction_kl),   k3_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1

and the step's loss is Σ_t w_t ℓ_t over every completion token of the optimizer step (all dp and cp
ranks, all micro-batches), w_t the loss type's normaliser taken over the **whole step**: dapo and bnpo
1/N (N: the step's trained tokens), grpo 1/(n_i · C) (C: the step's completions), dr_grpo
1/(C · max_completion_length). These are TRL's on one process with one micro-batch a step; the loss
does not change with the mesh or the accumulation. Old log-probs exist when a generation feeds more
than one pass (else old = logp, detached: the ratio is exactly 1 with logp's gradient, as TRL).

Log-probabilities come from the logits divided by grpo.temperature: through the fused vocab-parallel
path (dtrain.fused_loss: (hidden / T) @ Wᵀ, no full logits), or the model's own logits (`dense`).
Under context parallel a GSPO sequence's partial sums are all-reduced over cp, in backward too (each cp
rank's tokens are their own part of the loss); tp ranks hold the same tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtrain.config import GRPOConfig
from dtrain.data.prompts import token_place
from dtrain.fused_loss import fused_token_entropy, fused_token_logps
from dtrain.loss import IGNORE, loss_context
from dtrain.parallel.router import RouterStats
from dtrain.step import final_hidden_states, model_inputs

LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")
# The figures summed over a step's tokens (and clip counts over its sequences under GSPO), in this order.
FIGURES = ("loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class StepCounts:
    """What a step's loss is normalised by, over the whole optimizer step (every rank's completions)."""

    tokens: torch.Tensor  # completion tokens trained on (grpo.mask_truncated_completions leaves some out)
    completions: int  # completions in the step, those left out of the loss included (as TRL counts them)


def token_logps(
    model: torch.nn.Module,
    micro_batch: dict[str, Any],
    loss_impl: str,
    loss_chunk: int,
    temperature: float,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, local] fp32 log-probability of each target under softmax(logits / T), 0 elsewhere; and
    (entropy) the tempered distribution's entropy there, without gradients (inside loss_context)."""
    inputs, labels = model_inputs(model, micro_batch), micro_batch["labels"]
    if loss_impl == "fused":
        hidden, head = final_hidden_states(model, inputs)
        hidden = hidden / temperature if temperature != 1.0 else hidden
        vocab = model.config.vocab_size
        logps = fused_token_logps(hidden, head.weight, labels, loss_chunk, vocab)
        spread = (
            fused_token_entropy(hidden.detach(), head.weight, labels, loss_chunk, vocab) if entropy else None
        )
        return logps, spread
    logits = model(**inputs).logits
    logits = logits / temperature if temperature != 1.0 else logits
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
    )
    logps = -(losses.to_local() if isinstance(losses, DTensor) else losses).view(labels.shape)
    spread = None
    if entropy:
        with torch.no_grad():
            whole = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()
            logp = torch.log_softmax(whole, dim=-1)
            spread = torch.where(labels != IGNORE, -(logp.exp() * logp).sum(-1), 0.0)
    return logps, spread


class _SharedSum(torch.autograd.Function):
    """All-reduce (sum) in forward and in backward: each rank's tokens are their own part of the loss,
    so every rank's share of a summed value gets the gradient of every rank's use of it."""

    @staticmethod
    def forward(ctx, tensor, group):  # noqa: ANN001, ANN205
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def sequence_sums(
    values: torch.Tensor, scored: torch.Tensor, sequence: torch.Tensor, count: int
) -> torch.Tensor:
    """[count]: `values` summed per sequence over the scored positions (the others into a spare slot:
    static shapes)."""
    index = torch.where(scored, sequence, count).flatten()
    sums = torch.zeros(count + 1, dtype=values.dtype, device=values.device)
    return sums.index_add(0, index, values.flatten())[:count]


def token_weights(settings: GRPOConfig, micro_batch: dict[str, Any], counts: StepCounts) -> torch.Tensor:
    """[sequences]: the loss type's normaliser of each sequence's tokens, over the whole step."""
    lengths = micro_batch["completion_tokens"].float()
    if (
        settings.loss_type == "grpo"
    ):  # each completion's token mean, then the mean over the step's completions
        return 1.0 / (lengths.clamp(min=1.0) * counts.completions)
    if settings.loss_type == "dr_grpo":
        return torch.full_like(lengths, 1.0 / (counts.completions * settings.max_completion_length))
    return torch.ones_like(lengths) / counts.tokens.clamp(min=1.0)  # dapo, bnpo


def grpo_loss(
    logps: torch.Tensor,
    spread: torch.Tensor | None,
    micro_batch: dict[str, Any],
    settings: GRPOConfig,
    counts: StepCounts,
    cp: DeviceMesh,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's share of the step's loss (a scalar to differentiate) and its FIGURES summed
    (float64, detached; the clip counts of GSPO's sequences on cp rank 0 only, each counted once)."""
    scored, sequence, flat = token_place(micro_batch)
    count = micro_batch["completion_tokens"].numel()
    mask = scored.float()
    detached = logps.detach()

    def per_token(key: str) -> torch.Tensor:  # a flat per-token tensor at each position (logp elsewhere)
        return torch.where(scored, micro_batch[key][flat], detached) if key in micro_batch else detached

    advantages = micro_batch["advantages"][sequence]
    log_ratio = logps - per_token("old_logps")
    if settings.importance_sampling_level == "sequence":
        sums = sequence_sums(log_ratio * mask, scored, sequence, count)
        if cp.size() > 1:
            sums = _SharedSum.apply(sums, cp.get_group())
        per_sequence = torch.exp(sums / micro_batch["completion_tokens"].float().clamp(min=1.0))
        ratio = per_sequence[sequence]
    else:
        ratio = torch.exp(log_ratio)
    high = settings.epsilon if settings.epsilon_high is None else settings.epsilon_high
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + high)
    capped = torch.clamp(ratio, max=settings.delta) if settings.delta is not None else ratio
    loss = -torch.min(capped * advantages, clipped * advantages)
    if "is_ratio" in micro_batch:
        loss = loss * per_token("is_ratio")
    kl = torch.zeros_like(logps)
    if settings.beta != 0.0:
        gap = per_token("ref_logps") - logps
        kl = torch.exp(gap) - gap - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + settings.beta * kl
    weights = token_weights(settings, micro_batch, counts)[sequence]
    total = (loss * weights * mask).sum()

    with torch.no_grad():
        low = ((capped < 1 - settings.epsilon) & (advantages < 0)).float()
        high_clip = ((capped > 1 + high) & (advantages > 0)).float()
        region = torch.maximum(low, high_clip)
        if settings.importance_sampling_level == "sequence":  # TRL: a mean over sequences
            first = cp.get_local_rank() == 0
            seq_adv = micro_batch["advantages"]
            seq_ratio = (
                torch.clamp(per_sequence, max=settings.delta) if settings.delta is not None else per_sequence
            )
            seq_low = ((seq_ratio < 1 - settings.epsilon) & (seq_adv < 0)).float()
            seq_high = ((seq_ratio > 1 + high) & (seq_adv > 0)).float()
            clips = [c.sum() * first for c in (seq_low, seq_high, torch.maximum(seq_low, seq_high))]
        else:
            clips = [(c * mask).sum() for c in (low, high_clip, region)]
        spread_sum = (spread * mask).sum() if spread is not None else torch.zeros((), device=logps.device)
        figures = torch.stack([total.detach(), (kl.detach() * mask).sum(), spread_sum, *clips]).double()
    return total, figures


def micro_step(
    model: torch.nn.Module,
    micro_batch: dict[str, Any],
    settings: GRPOConfig,
    counts: StepCounts,
    cp: DeviceMesh,
    loss_parallel: bool,
    loss_impl: str = "fused",
    loss_chunk: int = 256,
    router: RouterStats | None = None,
) -> torch.Tensor:
    """Forward, GRPO loss and backward of one micro-batch of completions; returns its FIGURES summed
    (detached). `router`: as in dtrain.step.micro_step."""
    recorded = router.record(micro_batch) if router is not None else contextlib.nullcontext()
    with loss_context(loss_parallel), recorded:
        logps, spread = token_logps(
            model, micro_batch, loss_impl, loss_chunk, settings.temperature, entropy=True
        )
        aux = router.aux_term() if router is not None else None
        total, figures = grpo_loss(logps, spread, micro_batch, settings, counts, cp)
        (total if aux is None else total + aux).backward()
    return figures
