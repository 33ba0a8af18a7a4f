"""DPO's loss on the mesh (dtrain.dpo): each sequence's log-probability, TRL 1.16's pair losses, and the
forward + loss + backward of a micro-batch of pairs (`micro_step`, which dtrain.objectives.dpo.PairLoss
runs, as dtrain.objectives.sft.TokenLoss runs dtrain.step.micro_step).

A sequence's log-probability is the sum of its completion tokens' log-probabilities (fp32), as
TRL's DPOTrainer sums them (with `ld_alpha`, LD-DPO: the tokens past the pair's shorter completion
weighted by it): per token from the vocabulary-sharded head without the full logits
(dtrain.fused_loss.fused_token_logps; `dense`: loss parallel's cross-entropy per token), summed per
sequence by each target's `sequence_index` (dtrain/data/pairs.py), and under context parallel the
cp ranks' partial sums all-reduced, with the identity as backward (each rank's tokens take the
gradient of the whole sum).

The loss of a step is Σ over dpo.loss_type of its weight × the mean over the step's pairs of its ℓ_i:
each pair's ℓ_i summed over every micro-batch and dp rank, divided by the step's pair count, so it
is the same on any mesh and any accumulation. TRL averages each micro-batch, which is the same when
one micro-batch holds the whole step (what the tests compare). Two parts of TRL's loss are not sums
of per-pair terms, and dtrain takes them over the whole step: `sft`, the NLL of the chosen completions
(a mean over the step's chosen tokens), and `aot` / `aot_unpaired`, which pair the i-th smallest
policy log-ratio with the i-th smallest reference one. The sorted losses take the step's values
before its first gradient: a forward without gradients over the step's micro-batches first
(PairLoss.step_view), whose values every later forward repeats bit for bit; each pair's loss then
pairs it with its partner in the step's sorted order, which sums to TRL's loss over the sorted lists
and has its gradient.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
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

LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# TRL's losses built on the chosen − rejected score difference: the only ones with an f-divergence
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
SMOOTHED = ("robust", "exo_pair", "aot", "aot_unpaired")  # the losses that read label_smoothing
SORTED = ("aot", "aot_unpaired")  # pair the step's sorted log-ratios: need PairLoss.step_view
# The figures summed over a step's pairs (and `nll`, over its chosen tokens), in this order.
FIGURES = ("loss", "nll", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
FIGURES += ("logps/chosen", "logps/rejected")


def loss_types(settings: DPOConfig) -> list[tuple[str, float]]:
    """dpo.loss_type with dpo.loss_weights: (name, weight) each."""
    names = [settings.loss_type] if isinstance(settings.loss_type, str) else list(settings.loss_type)
    weights = settings.loss_weights or [1.0] * len(names)
    return list(zip(names, weights, strict=True))


def sft_weight(settings: DPOConfig) -> float:
    """The summed weight of the `sft` entries of dpo.loss_type (0: none)."""
    return sum(weight for name, weight in loss_types(settings) if name == "sft")


def sorts_pairs(settings: DPOConfig) -> bool:
    """Whether the loss pairs the step's sorted log-ratios (aot, aot_unpaired): it needs the step's
    values before its first gradient (PairLoss.step_view)."""
    return bool({name for name, _ in loss_types(settings)} & set(SORTED))


# --- each sequence's log-probability ------------------------------------------------------------


def with_tail(micro_batch: dict[str, Any], settings: DPOConfig) -> dict[str, Any]:
    """A host micro-batch with LD-DPO's `tail` [rows, max_len] (with dpo.ld_alpha set): True at the
    targets of a completion past the length (in scored tokens) of its pair's shorter completion, as
    TRL's `comp_pos > shared_len`. A sequence's targets are contiguous in its row, so a target's place
    in its completion is its position less its completion's first one. Built before the micro-batch is
    split over cp, like `sequence_index`."""
    if settings.ld_alpha is None:
        return micro_batch
    index = micro_batch["sequence_index"]
    count = micro_batch["completion_tokens"].numel()
    flat = index.flatten()
    sequence = torch.where(flat >= 0, flat, count)  # the non-targets into a spare last slot
    position = torch.arange(flat.numel())
    first = torch.full((count + 1,), flat.numel()).scatter_reduce(0, sequence, position, "amin")
    scored = torch.zeros(count + 1, dtype=torch.long).index_add(0, sequence, torch.ones_like(sequence))
    shared = scored[:count].view(-1, 2).min(1).values.repeat_interleave(2)
    shared = torch.cat([shared, shared.new_zeros(1)])
    place = position - first[sequence] + 1  # 1-based among its completion's targets
    tail = (flat >= 0) & (place > shared[sequence])
    return {**micro_batch, "tail": tail.view(index.shape)}


@dataclass
class Sums:
    """One micro-batch's per-sequence sums, [pairs, 2] each (chosen, rejected)."""

    logps: torch.Tensor  # TRL's log-probabilities (LD-DPO-weighted with ld_alpha): differentiable
    plain: torch.Tensor  # the plain sums of the token log-probabilities (the sft term's): differentiable
    scored: torch.Tensor  # the scored tokens (targets) of each completion
    weights: torch.Tensor | None  # WPO (use_weighting): exp(mean over targets of logp − log Σ_v p_v²)


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


def sequence_sums(
    model: torch.nn.Module,
    micro_batch: dict[str, Any],
    loss_impl: str,
    loss_chunk: int,
    cp: DeviceMesh,
    settings: DPOConfig,
    weights: bool = False,
) -> Sums:
    """Each pair's chosen and rejected sums (fp32; inside loss_context). `weights`: WPO's (the policy's
    log Σ_v p_v² per token, from the fused head's own chunks or the dense logits)."""
    inputs, labels = model_inputs(model, micro_batch), micro_batch["labels"]
    log_sum_sq = None
    if loss_impl == "fused":
        hidden, head = final_hidden_states(model, inputs)
        vocab = model.config.vocab_size
        tokens = fused_token_logps(hidden, head.weight, labels, loss_chunk, vocab, sum_sq=weights)
        if weights:
            tokens, log_sum_sq = tokens
    else:  # dense: the model's own (vocabulary-sharded) logits
        logits = model(**inputs).logits
        losses = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
        )
        tokens = -(losses.to_local() if isinstance(losses, DTensor) else losses).view(labels.shape)
        if weights:
            log_sum_sq = _dense_log_sum_sq(logits)
    # Each target into its sequence's sum, the other positions (log-prob 0) into a spare last slot:
    # static shapes (no boolean indexing), as the planner's fake tensors need.
    count = micro_batch["completion_tokens"].numel()
    index = micro_batch["sequence_index"].flatten()
    targets = index >= 0
    index = torch.where(targets, index, count)
    columns = [tokens]
    if settings.ld_alpha is not None:
        columns.append(tokens * micro_batch["tail"])
    sums = torch.zeros(count + 1, len(columns), dtype=torch.float32, device=tokens.device)
    sums = sums.index_add(0, index, torch.stack(columns, -1).flatten(0, 1))[:count]
    detached = [targets.float()] + ([(tokens.detach() - log_sum_sq).flatten()] if weights else [])
    counted = torch.zeros(count + 1, len(detached), dtype=torch.float32, device=tokens.device)
    counted = counted.index_add(0, index, torch.stack(detached, -1))[:count]
    if cp.size() > 1:
        sums = _SumOverRanks.apply(sums, cp.get_group())
        dist.all_reduce(counted, group=cp.get_group())
    plain = sums[:, 0]
    logps = plain if settings.ld_alpha is None else plain - (1 - settings.ld_alpha) * sums[:, 1]
    scored = counted[:, 0]
    pair_weights = None
    if weights:
        mean = counted[:, 1] / scored.clamp(min=1)
        pair_weights = torch.exp(mean).view(-1, 2)
    return Sums(logps.view(-1, 2), plain.view(-1, 2), scored.view(-1, 2), pair_weights)


def sequence_logps(
    model: torch.nn.Module,
    micro_batch: dict[str, Any],
    loss_impl: str,
    loss_chunk: int,
    cp: DeviceMesh,
    settings: DPOConfig,
) -> torch.Tensor:
    """[pairs, 2]: each pair's chosen and rejected log-probability, TRL's (inside loss_context)."""
    return sequence_sums(model, micro_batch, loss_impl, loss_chunk, cp, settings).logps


@torch.no_grad()
def _dense_log_sum_sq(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v p_v² of every position of the model's logits (gathered over tp: WPO with the dense loss)."""
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return torch.logsumexp(2 * torch.log_softmax(full.float(), -1), -1)


# --- the pair losses (TRL 1.16's DPOTrainer._compute_loss) ----------------------------------------


@dataclass
class Pairs:
    """What a pair's losses read, [pairs] or [pairs, 2] (chosen, rejected) each."""

    logps: torch.Tensor  # the policy's log-probabilities
    ref: torch.Tensor  # the reference's
    lengths: torch.Tensor  # the completions' token counts (TRL's completion mask), as floats
    scores: torch.Tensor  # the f-divergence's scores of the log-ratios (reverse_kl: the log-ratios)
    partners: torch.Tensor | None  # the sorted losses' partners (partners())

    @property
    def ratios(self) -> torch.Tensor:
        return self.logps - self.ref

    @property
    def delta(self) -> torch.Tensor:
        return self.scores[:, 0] - self.scores[:, 1]


def f_scores(ratios: torch.Tensor, settings: DPOConfig) -> torch.Tensor:
    """f-DPO: f'(exp(log-ratio)) of each log-ratio (reverse_kl: the log-ratio itself)."""
    kind = settings.f_divergence_type
    if kind == "forward_kl":  # f'(t) = 1 − 1/t
        return 1 - torch.exp(-ratios)
    if kind == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(ratios)
    coef = settings.f_alpha_divergence_coef
    if kind == "alpha_divergence" and abs(coef - 1.0) >= 1e-6:  # f'(t) = (t^(α−1) − 1) / (α − 1)
        # TRL clamps the exponent at 80 (its fp32 and bf16 limit) and computes it in fp32
        scaled = torch.clamp(((coef - 1.0) * ratios).float(), max=80.0)
        return (torch.exp(scaled) - 1.0) * (1.0 / (coef - 1.0))
    return ratios  # reverse_kl, and alpha_divergence's limit at α = 1


def _logistic(x: torch.Tensor, smoothing: float) -> torch.Tensor:
    """aot's and aot_unpaired's smoothed logistic loss of a sorted margin."""
    return -F.logsigmoid(x) * (1 - smoothing) - F.logsigmoid(-x) * smoothing


def pair_loss(name: str, pairs: Pairs, settings: DPOConfig) -> torch.Tensor:
    """ℓ_i of one loss type ([pairs]); `sft` has none per pair (micro_step adds its step mean)."""
    beta, eps = settings.beta, settings.label_smoothing
    ratios, delta = pairs.ratios, pairs.delta
    chosen, rejected = beta * ratios[:, 0], beta * ratios[:, 1]
    if name == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if name == "hinge":
        return torch.relu(1 - beta * delta)
    if name in ("ipo", "sigmoid_norm"):  # scores normalised by the completions' lengths
        per_token = pairs.scores / pairs.lengths.clamp(min=1.0)
        margin = per_token[:, 0] - per_token[:, 1]
        return (margin - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * margin)
    if name == "exo_pair":
        log_pw, log_pl = math.log1p(-eps), math.log(eps)
        won, lost = beta * delta, -beta * delta
        return torch.sigmoid(won) * (F.logsigmoid(won) - log_pw) + torch.sigmoid(lost) * (
            F.logsigmoid(lost) - log_pl
        )
    if name == "nca_pair":
        return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    if name == "robust":
        clean, flipped = -(1 - eps) * F.logsigmoid(beta * delta), -eps * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * eps)
    if name == "bco_pair":
        return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
    if name == "sppo_hard":
        return (ratios[:, 0] - 0.5 / beta) ** 2 + (ratios[:, 1] + 0.5 / beta) ** 2
    if name == "aot":  # its policy log-ratio margin against the reference's of the same rank
        assert pairs.partners is not None
        margin = pairs.logps[:, 0] - pairs.logps[:, 1]
        return _logistic(beta * (margin - pairs.partners[:, 0]), eps)
    if name == "aot_unpaired":
        # Σ_k g(c_(k) − r_(k)): the chosen log-ratio against the rejected one of its rank, the rejected
        # against the chosen of its rank; each term is in both sums, its value once
        assert pairs.partners is not None
        as_chosen = _logistic(beta * (ratios[:, 0] - pairs.partners[:, 1]), eps)
        as_rejected = _logistic(beta * (pairs.partners[:, 2] - ratios[:, 1]), eps)
        return as_chosen + as_rejected - as_chosen.detach()
    if name == "apo_zero":
        return (1 - torch.sigmoid(chosen)) + torch.sigmoid(rejected)
    if name == "apo_down":
        return torch.sigmoid(chosen) + (1 - torch.sigmoid(beta * (ratios[:, 0] - ratios[:, 1])))
    if name == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / settings.discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    raise ValueError(f"dpo.loss_type={name!r}")


def pair_losses(settings: DPOConfig, pairs: Pairs, weights: torch.Tensor | None) -> torch.Tensor:
    """ℓ_i of each pair: the weighted sum of dpo.loss_type's per-pair losses ([pairs]; `sft` is
    micro_step's), times the pair's WPO weight (use_weighting)."""
    total = torch.zeros(len(pairs.logps), device=pairs.logps.device)
    for name, weight in loss_types(settings):
        if name != "sft":
            total = total + weight * pair_loss(name, pairs, settings)
    if weights is not None:
        total = total * weights.prod(1)
    return total


def make_pairs(
    settings: DPOConfig,
    logps: torch.Tensor,
    ref: torch.Tensor,
    lengths: torch.Tensor,
    partners: torch.Tensor | None = None,
) -> Pairs:
    return Pairs(logps, ref, lengths.to(logps.dtype), f_scores(logps - ref, settings), partners)


def partners(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[pairs, 3] over a whole step (or eval set): each pair's partners in the sorted orders TRL's
    sorted losses pair: the reference margin of its policy margin's rank (aot); the rejected log-ratio
    of its chosen log-ratio's rank and the chosen one of its rejected log-ratio's rank (aot_unpaired)."""

    def of_rank(values: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(values, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=order.device)
        return torch.sort(other, stable=True).values[rank]

    ratios = logps - ref
    return torch.stack(
        [
            of_rank(logps[:, 0] - logps[:, 1], ref[:, 0] - ref[:, 1]),
            of_rank(ratios[:, 0], ratios[:, 1]),
            of_rank(ratios[:, 1], ratios[:, 0]),
        ],
        1,
    )


@dataclass
class StepTotals:
    """What a step's loss is a mean over, the same on every rank: its pairs and its chosen tokens
    (over every micro-batch and dp rank)."""

    pairs: torch.Tensor
    chosen_tokens: torch.Tensor


def micro_step(
    model: torch.nn.Module,
    micro_batch: dict[str, Any],
    totals: StepTotals,
    settings: DPOConfig,
    cp: DeviceMesh,
    loss_parallel: bool,
    loss_impl: str = "fused",
    loss_chunk: int = 256,
    router: RouterStats | None = None,
) -> torch.Tensor:
    """Forward, DPO loss and backward of one micro-batch of pairs (its `ref_logps` set: the reference
    policy's [pairs, 2]; its `partners` with a sorted loss); the per-pair losses divided by the step's
    pairs, `sft`'s NLL by its chosen tokens. Returns the micro-batch's FIGURES summed over its pairs,
    detached. `router`: as in dtrain.step.micro_step."""
    recorded = router.record(micro_batch) if router is not None else contextlib.nullcontext()
    with loss_context(loss_parallel), recorded:
        sums = sequence_sums(model, micro_batch, loss_impl, loss_chunk, cp, settings, settings.use_weighting)
        aux = router.aux_term() if router is not None else None
        ref = micro_batch["ref_logps"]
        lengths = micro_batch["completion_tokens"].view(-1, 2)
        pairs = make_pairs(settings, sums.logps, ref, lengths, micro_batch.get("partners"))
        losses = pair_losses(settings, pairs, sums.weights)
        total = losses.sum() / totals.pairs
        if sft := sft_weight(settings):
            total = total - sft * sums.plain[:, 0].sum() / totals.chosen_tokens
        (total if aux is None else total + aux).backward()
    nll = -sums.plain.detach()[:, 0].double().sum()
    return figures(settings, losses.detach(), nll, sums.logps.detach(), ref)


def set_figures(
    settings: DPOConfig,
    logps: torch.Tensor,
    ref: torch.Tensor,
    lengths: torch.Tensor,
    plain: torch.Tensor,
    scored: torch.Tensor,
    weights: torch.Tensor | None,
) -> dict[str, Any]:
    """The loss and TRL's figures of a whole set of pairs taken as one batch (dtrain.dpo's eval): the
    per-pair losses' mean, the sorted losses over the whole set, `sft`'s NLL a mean over its chosen
    tokens, the rewards' and log-probs' means; `tokens`: the completion tokens scored."""
    names = {name for name, _ in loss_types(settings)}
    partnered = partners(logps, ref) if names & set(SORTED) else None
    losses = pair_losses(settings, make_pairs(settings, logps, ref, lengths, partnered), weights)
    loss = losses.mean()
    nll = -plain[:, 0].sum() / scored[:, 0].sum()
    if sft := sft_weight(settings):
        loss = loss + sft * nll
    rewards = settings.beta * (logps - ref)
    result = {
        "loss": loss.item(),
        "rewards/chosen": rewards[:, 0].mean().item(),
        "rewards/rejected": rewards[:, 1].mean().item(),
        "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().mean().item(),
        "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean().item(),
        "logps/chosen": logps[:, 0].mean().item(),
        "logps/rejected": logps[:, 1].mean().item(),
    }
    if sft:
        result["nll_loss"] = nll.item()
    return result | {"tokens": int(scored.sum().item())}


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
