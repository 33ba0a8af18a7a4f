"""What the loop optimizes: an `Objective` per step, called by trainer.train in three places.

- `begin_step(micro_batches)`: this rank's micro-batches of the step, before its first gradient: the
  step's global counts (what the loss is a mean over: supervised tokens, pairs), and the router's
  start of the step (a mixture-of-experts model; with its aux loss over the global batch,
  `moe.aux_scope=global_batch`, the step's routes counted first).
- `micro_step(micro_batch)`: forward, loss and backward of one micro-batch (the loss divided by the
  global count, so the gradients summed over micro-batches and ranks are the global batch's mean);
  its summed loss and figures accumulate, detached.
- `figures()` (a collective): the step's logged figures, reduced over the ranks: `loss`, `tokens`,
  the non-pad slots, and the objective's own (the router's `aux_loss` and `expert_load`; DPO's
  rewards).

SFT's token loss is `TokenLoss`, DPO's pair loss `PairLoss` (dtrain.dpo); the router's aux term
lives here, behind every objective: its share of each micro-batch is added to what is differentiated
(each micro-step function takes the router) and its figures, with coef · aux_loss added to the logged
loss, come with every objective's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtrain import dpo_loss
from dtrain.config import Config, DPOConfig, MoeConfig
from dtrain.distributed import Parallel
from dtrain.loss import IGNORE, LossSettings, loss_context
from dtrain.parallel.router import RouterStats
from dtrain.reference import Reference
from dtrain.step import evaluate, global_counts, micro_step, summed_loss


@dataclass
class StepFigures:
    """A step's logged figures, the same on every rank: its loss (what was differentiated, the aux
    term included), supervised tokens, non-pad slots, and the objective's own figures."""

    loss: float
    tokens: int
    filled: float
    extra: dict[str, Any] = field(default_factory=dict)


class Objective:
    """The parts every objective shares: the model, the mesh, the loss settings and the router."""

    def __init__(
        self, model: torch.nn.Module, parallel: Parallel, loss: LossSettings, moe: MoeConfig
    ) -> None:
        self.model, self.parallel, self.loss = model, parallel, loss
        # mixture of experts: routing figures and the aux loss (moe: its scope and padding)
        self.router = RouterStats.attach(model, parallel, moe)
        self.tokens = torch.zeros((), device=parallel.device)  # the step's supervised tokens
        self.frozen: list[torch.nn.Module] = []  # models it runs besides `model` (DPO's live reference)

    def begin_step(self, micro_batches: list[dict[str, Any]]) -> None:
        """The step's global counts (`count`), then the router's start of the step, whose counting
        forward (aux loss only) runs the objective's own forward."""
        self.count(micro_batches)
        if self.router is not None:
            with loss_context(self.loss.parallel):
                self.router.begin_step(micro_batches, self.forward)

    def figures(self) -> StepFigures:
        """The step's figures (a collective: every rank calls it)."""
        figures = self.reduce()
        if self.router is not None:
            routing = self.router.figures()
            figures.loss += self.router.coef * routing.get("aux_loss", 0.0)  # the loss HF trains with
            figures.extra |= routing
        return figures

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def forward(self, micro_batch: dict[str, Any]) -> Any:
        """The forward whose routes the router records (inside loss_context)."""
        raise NotImplementedError

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        raise NotImplementedError

    def reduce(self) -> StepFigures:
        raise NotImplementedError

    def evaluate(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError


class TokenLoss(Objective):
    """SFT: the cross-entropy summed over the step's supervised tokens, divided by their count over
    every micro-batch of every dp and cp rank (a token mean of the global batch on any mesh)."""

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        self.tokens, self.filled = global_counts(micro_batches, self.parallel)
        self.loss_sum = torch.zeros((), device=self.parallel.device)

    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        return summed_loss(self.model, micro_batch, self.loss.impl, self.loss.chunk)

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        self.loss_sum += micro_step(self.model, micro_batch, self.tokens, *self.loss, router=self.router)

    def reduce(self) -> StepFigures:
        dist.all_reduce(self.loss_sum, group=self.parallel.token_group)
        mean = (self.loss_sum / self.tokens).item()
        return StepFigures(mean, int(self.tokens.item()), self.filled.item())

    def evaluate(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        return evaluate(self.model, micro_batches, self.parallel, *self.loss)


class PairLoss(Objective):
    """DPO (dtrain.dpo): Σ over the step's pairs of ℓ_i, divided by the step's pair count over every
    dp rank (dtrain.dpo_loss), plus dpo.sft_weight × the NLL of the chosen completions (a mean over
    the step's chosen tokens), plus the router's aux term. Each step's reference log-probs are set
    before its first gradient (dtrain.reference)."""

    def __init__(
        self,
        model: torch.nn.Module,
        parallel: Parallel,
        loss: LossSettings,
        moe: MoeConfig,
        settings: DPOConfig,
        reference: Reference,
    ) -> None:
        super().__init__(model, parallel, loss, moe)
        self.settings, self.reference = settings, reference
        if reference.mode == "live":
            self.frozen.append(reference.model)

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        self.tokens, self.filled = global_counts(micro_batches, self.parallel)
        pairs = sum(mb["pair_index"].numel() for mb in micro_batches)
        self.pairs = torch.tensor(float(pairs), device=self.parallel.device)
        dist.all_reduce(self.pairs, group=self.parallel["dp"].get_group())  # tp, cp ranks: the same pairs
        chosen = sum(
            ((mb["sequence_index"] % 2 == 0) & (mb["labels"] != IGNORE)).sum() for mb in micro_batches
        )
        self.chosen_tokens = torch.as_tensor(chosen, device=self.parallel.device).float()
        dist.all_reduce(self.chosen_tokens, group=self.parallel.token_group)
        self.reference.set_logps(micro_batches)
        self.sums = torch.zeros(len(dpo_loss.FIGURES), dtype=torch.float64, device=self.parallel.device)

    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        return dpo_loss.sequence_logps(
            self.model, micro_batch, self.loss.impl, self.loss.chunk, self.parallel["cp"]
        )

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        self.sums += dpo_loss.micro_step(
            self.model,
            micro_batch,
            self.pairs,
            self.chosen_tokens,
            self.settings,
            self.parallel["cp"],
            *self.loss,
            router=self.router,
        )

    def reduce(self) -> StepFigures:
        dist.all_reduce(self.sums, group=self.parallel["dp"].get_group())
        figures = dict(zip(dpo_loss.FIGURES, (self.sums / self.pairs).tolist(), strict=True))
        nll = (self.sums[1] / self.chosen_tokens).item()
        loss = figures.pop("loss") + self.settings.sft_weight * nll
        figures.pop("nll")
        if self.settings.sft_weight:
            figures["nll_loss"] = nll
        return StepFigures(loss, int(self.tokens.item()), self.filled.item(), figures)


def build_objective(
    config: Config,
    model: torch.nn.Module,
    parallel: Parallel,
    reference_model: Callable[[], torch.nn.Module] | None = None,
    table: Callable[[], torch.Tensor] | None = None,
) -> Objective:
    """The objective a run (or a plan) trains with: DPO's for preference pairs, with its reference,
    else SFT's token loss. dpo.reference=live: `reference_model()`, a frozen copy of the policy;
    precompute: `table()`, the reference log-probs of every pair (dtrain.reference.precomputed)."""
    loss = LossSettings.of(config.parallel)
    if not config.data.preference:
        return TokenLoss(model, parallel, loss, config.moe)
    mode = config.dpo.reference
    if (mode == "live" and reference_model is None) or (mode == "precompute" and table is None):
        raise ValueError(f"dpo.reference={mode}: build_objective needs its reference_model or table")
    reference = Reference(mode, parallel, loss, reference_model() if mode == "live" else model)
    if mode == "precompute":
        reference.table = table()
    return PairLoss(model, parallel, loss, config.moe, config.dpo, reference)
