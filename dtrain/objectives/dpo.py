"""DPO's objective (dtrain.dpo): the pair loss of dtrain.objectives.dpo_loss over preference pairs,
with its reference (dtrain.objectives.reference); docs/dpo.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtrain.config import Config, ConfigError, DPOConfig, MoeConfig, PreferenceConfig
from dtrain.data.formats import PAIR_FEATURES
from dtrain.distributed import Parallel
from dtrain.loss import IGNORE, LossSettings
from dtrain.objectives import dpo_loss
from dtrain.objectives.base import Context, Objective, ObjectiveSpec, StepFigures
from dtrain.objectives.reference import Reference, precomputed
from dtrain.parallel import lora
from dtrain.step import global_counts

REFERENCES = ("auto", "precompute", "live", "adapters_off")


class PairLoss(Objective):
    """DPO (dtrain.dpo): Σ over the step's pairs of ℓ_i, divided by the step's pair count over every
    dp rank (dtrain.objectives.dpo_loss), plus dpo.sft_weight × the NLL of the chosen completions (a mean over
    the step's chosen tokens), plus the router's aux term. Each step's reference log-probs are set
    before its first gradient (dtrain.objectives.reference)."""

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
        self.tokens, self.filled, self.slots = global_counts(micro_batches, self.parallel)
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
        return StepFigures(loss, int(self.tokens.item()), figures)


def build(context: Context) -> PairLoss:
    """DPO's pair loss with its reference: dpo.reference=live, `context.frozen_copy()`;
    precompute, the reference log-probs of every pair (`context.reference_table()`, else computed from
    the run's data at step 0 or read from its run folder: dtrain.objectives.reference.precomputed)."""
    config, model, parallel = context.config, context.model, context.parallel
    loss, mode = LossSettings.of(config.parallel), config.dpo.reference
    if mode == "live" and context.frozen_copy is None:
        raise ValueError("dpo.reference=live: the objective needs a frozen copy of the policy (frozen_copy)")
    reference = Reference(mode, parallel, loss, context.frozen_copy() if mode == "live" else model)
    if mode == "precompute":
        table = context.reference_table
        if table is None:
            reference.table = precomputed(
                config,
                model,
                context.data.train,
                parallel,
                context.run_dir,
                context.step,
                context.resume_from,
            )
        else:
            reference.table = table()
    return PairLoss(model, parallel, loss, config.moe, config.dpo, reference)


def check(config: Config) -> None:
    """dpo.*'s values; dpo.reference=auto resolved (adapters_off for LoRA from fresh adapters, else
    precompute)."""
    settings = config.dpo
    names = [settings.loss_type] if isinstance(settings.loss_type, str) else list(settings.loss_type)
    if not names:
        raise ConfigError("dpo.loss_type=[]: name at least one loss")
    for name in names:
        if name not in dpo_loss.LOSSES:
            raise ConfigError(f"dpo.loss_type={name!r}: must be one of {', '.join(dpo_loss.LOSSES)}")
    if settings.loss_weights is not None and len(settings.loss_weights) != len(names):
        raise ConfigError(
            f"dpo.loss_weights={list(settings.loss_weights)}: one weight per dpo.loss_type ({len(names)})"
        )
    if not settings.beta > 0:
        raise ConfigError(f"dpo.beta={settings.beta}: must be > 0")
    if not 0.0 <= settings.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={settings.label_smoothing}: must be in [0, 0.5)")
    if settings.sft_weight < 0:
        raise ConfigError(f"dpo.sft_weight={settings.sft_weight}: must be >= 0")
    if settings.reference not in REFERENCES:
        raise ConfigError(f"dpo.reference={settings.reference!r}: must be one of {', '.join(REFERENCES)}")
    adapters = lora.enabled(config.lora)
    if settings.reference == "adapters_off" and not adapters:
        raise ConfigError("dpo.reference=adapters_off: needs LoRA adapters (lora.r > 0 or lora.adapter)")
    if settings.reference == "auto":  # resolved here, so config.yaml says which reference ran
        fresh = adapters and not config.lora.adapter
        settings.reference = "adapters_off" if fresh else "precompute"
    if config.parallel.loss_impl == "chunked":
        raise ConfigError("parallel.loss_impl=chunked: dtrain.dpo takes dense or fused (auto picks)")
    if config.train.eval_every:
        raise ConfigError(f"train.eval_every={config.train.eval_every}: dtrain.dpo has no eval yet (set 0)")


def record_resolved(config: Config, resolved: dict[str, Any]) -> None:
    resolved["dpo"]["reference"] = config.dpo.reference  # config.yaml shows what ran (auto resolved)


SPEC = ObjectiveSpec(
    name="dpo",
    schema=PreferenceConfig,
    config_name="config_dpo",
    embedded="+experiment=embedded_dpo",
    features=PAIR_FEATURES,
    build=build,
    check=check,
    record_resolved=record_resolved,
)
