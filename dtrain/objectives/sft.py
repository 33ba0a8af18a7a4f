"""SFT's objective (dtrain.sft): the cross-entropy of the supervised tokens, a token mean over the
global batch (dtrain.step's micro_step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import Config
from dtrain.data.formats import FEATURES
from dtrain.loss import LossSettings
from dtrain.objectives.base import Context, Objective, ObjectiveSpec, StepFigures
from dtrain.step import evaluate, global_counts, micro_step, summed_loss


class TokenLoss(Objective):
    """SFT: the cross-entropy summed over the step's supervised tokens, divided by their count over
    every micro-batch of every dp and cp rank (a token mean of the global batch on any mesh)."""

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        self.tokens, self.filled, self.slots = global_counts(micro_batches, self.parallel)
        self.loss_sum = torch.zeros((), device=self.parallel.device)

    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        return summed_loss(self.model, micro_batch, self.loss.impl, self.loss.chunk)

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        self.loss_sum += micro_step(self.model, micro_batch, self.tokens, *self.loss, router=self.router)

    def reduce(self) -> StepFigures:
        dist.all_reduce(self.loss_sum, group=self.parallel.token_group)
        mean = (self.loss_sum / self.tokens).item()
        return StepFigures(mean, int(self.tokens.item()))

    def evaluate(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        return evaluate(self.model, micro_batches, self.parallel, *self.loss)


def build(context: Context) -> TokenLoss:
    config = context.config
    return TokenLoss(context.model, context.parallel, LossSettings.of(config.parallel), config.moe)


SPEC = ObjectiveSpec(
    name="sft",
    schema=Config,
    config_name="config",
    embedded="+experiment=embedded",
    features=FEATURES,
    build=build,
)
