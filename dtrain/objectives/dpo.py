"""DPO's objective (dtrain.dpo): TRL 1.16's pair losses (dtrain.objectives.dpo_loss) over preference
pairs, with its reference (dtrain.objectives.reference), its eval on held-out pairs and TR-DPO's
reference sync; docs/dpo.md."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from dtrain.config import Config, ConfigError, DPOConfig, MoeConfig, PreferenceConfig
from dtrain.data.formats import PAIR_FEATURES
from dtrain.distributed import Parallel
from dtrain.loss import IGNORE, LossSettings, loss_context
from dtrain.objectives import dpo_loss
from dtrain.objectives.base import Context, HostBatches, Objective, ObjectiveSpec, StepFigures
from dtrain.objectives.dpo_loss import StepTotals, sequence_sums, with_tail
from dtrain.objectives.reference import Reference, describe, gathered, precomputed
from dtrain.parallel import lora
from dtrain.parallel.parallelize import reshard
from dtrain.step import global_counts, local_micro_batch

REFERENCES = ("auto", "precompute", "live", "adapters_off")


class PairLoss(Objective):
    """DPO (dtrain.dpo): Σ over dpo.loss_type of its weight × the mean of its per-pair losses over the
    step's pairs (every dp rank's), the `sft` term a mean over the step's chosen tokens
    (dtrain.objectives.dpo_loss), plus the router's aux term. Each step's reference log-probs are set
    before its first gradient (dtrain.objectives.reference), and with a sorted loss the step's sorted
    orders (step_view)."""

    def __init__(
        self,
        model: torch.nn.Module,
        parallel: Parallel,
        loss: LossSettings,
        moe: MoeConfig,
        settings: DPOConfig,
        reference: Reference,
        description: str = "",
    ) -> None:
        super().__init__(model, parallel, loss, moe)
        self.settings, self.reference, self.description = settings, reference, description
        if reference.mode == "live":
            self.frozen.append(reference.model)

    def next_batches(self, step: int, read: Callable[[], HostBatches]) -> list[dict[str, Any]]:
        return [self.local(micro_batch) for micro_batch in read()]

    def local(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """This rank's part of a host micro-batch (LD-DPO's `tail` first: before the cp split)."""
        return local_micro_batch(with_tail(micro_batch, self.settings), self.parallel)

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        self.tokens, self.filled, self.slots = global_counts(micro_batches, self.parallel)
        pairs = sum(mb["pair_index"].numel() for mb in micro_batches)
        pairs = torch.tensor(float(pairs), device=self.parallel.device)
        dist.all_reduce(pairs, group=self.parallel["dp"].get_group())  # tp, cp ranks: the same pairs
        chosen = sum(
            ((mb["sequence_index"] % 2 == 0) & (mb["labels"] != IGNORE)).sum() for mb in micro_batches
        )
        chosen_tokens = torch.as_tensor(chosen, device=self.parallel.device).float()
        dist.all_reduce(chosen_tokens, group=self.parallel.token_group)
        self.reference.set_logps(micro_batches)
        if dpo_loss.sorts_pairs(self.settings):
            self.step_view(micro_batches)
        self.totals = StepTotals(pairs, chosen_tokens)
        self.sums = torch.zeros(len(dpo_loss.FIGURES), dtype=torch.float64, device=self.parallel.device)

    @torch.no_grad()
    def step_view(self, micro_batches: list[dict[str, Any]]) -> None:
        """The step's policy log-probabilities before its first gradient (a forward without gradients
        of each micro-batch, which micro_step repeats bit for bit), gathered over dp: each
        micro-batch's `partners` in the step's sorted orders (dpo_loss.partners)."""
        with loss_context(self.loss.parallel):
            logps = [sequence_sums(self.model, mb, *self.settings_of_loss()).logps for mb in micro_batches]
        reshard(self.model)
        mine = torch.cat([torch.cat(logps), torch.cat([mb["ref_logps"] for mb in micro_batches])], 1)
        every = gathered(mine, self.parallel).flatten(0, 1)  # every dp rank's pairs of the step
        partners = dpo_loss.partners(every[:, 0:2], every[:, 2:4])
        start = self.parallel.dp_rank * len(mine)
        parts = partners[start : start + len(mine)].split([len(part) for part in logps])
        for mb, part in zip(micro_batches, parts, strict=True):
            mb["partners"] = part

    def settings_of_loss(self) -> tuple:
        """sequence_sums' arguments after the model and micro-batch."""
        return self.loss.impl, self.loss.chunk, self.parallel["cp"], self.settings

    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        return sequence_sums(self.model, micro_batch, *self.settings_of_loss()).logps

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        self.sums += dpo_loss.micro_step(
            self.model,
            micro_batch,
            self.totals,
            self.settings,
            self.parallel["cp"],
            *self.loss,
            router=self.router,
        )

    def reduce(self) -> StepFigures:
        dist.all_reduce(self.sums, group=self.parallel["dp"].get_group())
        pairs, chosen_tokens = self.totals.pairs, self.totals.chosen_tokens
        figures = dict(zip(dpo_loss.FIGURES, (self.sums / pairs).tolist(), strict=True))
        nll = (self.sums[1] / chosen_tokens).item()
        sft = dpo_loss.sft_weight(self.settings)
        loss = figures.pop("loss") + sft * nll
        figures.pop("nll")
        if sft:
            figures["nll_loss"] = nll
        return StepFigures(loss, int(self.tokens.item()), figures)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's eval metrics (`eval_` and the training figures' names) over the whole eval set, as one
        batch: every dp rank's share gathered, the loss's means and sorts over all of it."""
        settings = self.settings
        batches = [self.local(mb) for mb in micro_batches]
        self.model.eval()
        self.reference.set_logps(batches, evaluating=True)
        rows = []
        with loss_context(self.loss.parallel):
            for mb in batches:
                sums = sequence_sums(self.model, mb, *self.settings_of_loss(), settings.use_weighting)
                lengths = mb["completion_tokens"].view(-1, 2).float()
                parts = [sums.logps, mb["ref_logps"], lengths, sums.plain, sums.scored]
                parts += [sums.weights] if settings.use_weighting else []
                rows.append(torch.cat(parts, 1).cpu())
        self.model.train()
        reshard(self.model)
        shares: list[Any] = [None] * self.parallel.dp_size
        dist.all_gather_object(shares, rows, group=self.parallel["dp"].get_group())
        every = torch.cat([row for share in shares for row in share]).to(self.parallel.device)
        weights = every[:, 10:12] if settings.use_weighting else None
        figures = dpo_loss.set_figures(
            settings, every[:, 0:2], every[:, 2:4], every[:, 4:6], every[:, 6:8], every[:, 8:10], weights
        )
        return {"eval_loss": figures.pop("loss"), **{f"eval_{key}": value for key, value in figures.items()}}

    def end_step(self, step: int) -> None:
        settings = self.settings
        if settings.sync_ref_model and step % settings.ref_model_sync_steps == 0:
            self.reference.sync(self.model)

    def state_dict(self) -> dict[str, Any]:
        """TR-DPO's reference, which the syncs moved away from any model on disk."""
        if not self.settings.sync_ref_model:
            return {}
        return {"reference": get_model_state_dict(self.reference.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            set_model_state_dict(self.reference.model, state["reference"])

    def describe(self) -> str:
        return self.description


def build(context: Context) -> PairLoss:
    """DPO's pair loss with its reference: dpo.reference=live, `context.frozen(dpo.ref_model)`;
    precompute, the reference log-probs of every pair (`context.reference_table()`, else computed from
    the run's data at step 0 or read from its run folder: dtrain.objectives.reference.precomputed)."""
    config, model, parallel = context.config, context.model, context.parallel
    settings = config.dpo
    loss, mode = LossSettings.of(config.parallel), settings.reference
    if mode in ("live", "precompute") and context.frozen is None and context.reference_table is None:
        raise ValueError(f"dpo.reference={mode}: the objective needs a frozen model builder (Context.frozen)")
    frozen = context.frozen(settings.ref_model) if mode == "live" else model
    if settings.sync_ref_model:
        check_same_parameters(model, frozen, settings)
    reference = Reference(mode, parallel, loss, settings, frozen)
    if mode == "precompute":
        if context.reference_table is not None:
            reference.table = context.reference_table()
        else:
            assert context.frozen is not None
            train, evals = context.data.train, context.data.eval
            precomputed(
                config, reference, model, context.frozen, train, evals, context.run_dir, context.step,
                context.resume_from,
            )  # fmt: skip
    said = describe(mode, settings, lora.enabled(config.lora))
    return PairLoss(model, parallel, loss, config.moe, settings, reference, said)


def check_same_parameters(policy: torch.nn.Module, reference: torch.nn.Module, settings: DPOConfig) -> None:
    """TR-DPO mixes the reference with the policy parameter by parameter: the same shapes, sharded
    alike (dpo.ref_model of another architecture cannot sync)."""
    mine = [(tuple(p.shape), getattr(p, "placements", None)) for p in policy.parameters()]
    theirs = [(tuple(p.shape), getattr(p, "placements", None)) for p in reference.parameters()]
    if mine != theirs:
        raise ConfigError(
            f"dpo.sync_ref_model=true: the reference ({settings.ref_model or 'the starting policy'}) does "
            "not have the policy's parameters, so it cannot be mixed with it (another architecture)"
        )


def check(config: Config) -> None:
    """dpo.*'s values (TRL 1.16's rules, and a key set without the setting that reads it refused);
    dpo.reference=auto resolved."""
    settings = config.dpo
    names = [settings.loss_type] if isinstance(settings.loss_type, str) else list(settings.loss_type)
    if not names:
        raise ConfigError("dpo.loss_type=[]: name at least one loss")
    for name in names:
        if name not in dpo_loss.LOSS_TYPES:
            raise ConfigError(f"dpo.loss_type={name!r}: must be one of {', '.join(dpo_loss.LOSS_TYPES)}")
    if settings.loss_weights is not None and len(settings.loss_weights) != len(names):
        raise ConfigError(
            f"dpo.loss_weights={list(settings.loss_weights)}: one weight per dpo.loss_type ({len(names)})"
        )
    if not settings.beta > 0:
        raise ConfigError(f"dpo.beta={settings.beta}: must be > 0")
    check_loss_keys(settings, names)
    check_reference(config, names)
    if config.parallel.loss_impl == "chunked":
        raise ConfigError("parallel.loss_impl=chunked: dtrain.dpo takes dense or fused (auto picks)")


def check_loss_keys(settings: DPOConfig, names: list[str]) -> None:
    smoothing = settings.label_smoothing
    if smoothing and not set(names) & set(dpo_loss.SMOOTHED):
        raise ConfigError(
            f"dpo.label_smoothing={smoothing}: no loss of dpo.loss_type={names} reads it (TRL 1.16's sigmoid "
            f"ignores it); it is ε of {', '.join(dpo_loss.SMOOTHED)}"
        )
    if not 0.0 <= smoothing < 1.0:
        raise ConfigError(f"dpo.label_smoothing={smoothing}: must be in [0, 1)")
    if "robust" in names and not smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={smoothing}: must be in [0, 0.5) for robust")
    if "exo_pair" in names and not smoothing > 0:
        raise ConfigError("dpo.label_smoothing=0.0: exo_pair needs ε > 0 (the EXO paper suggests 1e-3)")
    if settings.ld_alpha is not None and not 0.0 <= settings.ld_alpha <= 1.0:
        raise ConfigError(f"dpo.ld_alpha={settings.ld_alpha}: must be in [0, 1] (unset: no LD-DPO)")
    kind = settings.f_divergence_type
    if kind not in dpo_loss.F_DIVERGENCES:
        choices = ", ".join(dpo_loss.F_DIVERGENCES)
        raise ConfigError(f"dpo.f_divergence_type={kind!r}: must be one of {choices}")
    others = [name for name in names if name not in dpo_loss.F_DIVERGENCE_LOSSES]
    if kind != "reverse_kl" and others:
        raise ConfigError(
            f"dpo.f_divergence_type={kind}: {', '.join(others)} has no f-divergence form; it takes "
            f"{', '.join(dpo_loss.F_DIVERGENCE_LOSSES)}"
        )
    if kind != "alpha_divergence" and settings.f_alpha_divergence_coef != DPOConfig.f_alpha_divergence_coef:
        raise ConfigError(
            f"dpo.f_alpha_divergence_coef={settings.f_alpha_divergence_coef} is set but "
            f"dpo.f_divergence_type={kind} (it is alpha_divergence's α)"
        )
    if "discopop" not in names and settings.discopop_tau != DPOConfig.discopop_tau:
        raise ConfigError(f"dpo.discopop_tau={settings.discopop_tau} is set but no dpo.loss_type is discopop")
    if not settings.discopop_tau > 0:
        raise ConfigError(f"dpo.discopop_tau={settings.discopop_tau}: must be > 0")
    if settings.use_weighting and set(names) & set(dpo_loss.SORTED):
        raise ConfigError(
            "dpo.use_weighting=true: not with aot or aot_unpaired (they sort the pairs, TRL refuses it too)"
        )
    if settings.use_weighting and "sft" in names:  # TRL multiplies sft's expanded batch loss in place
        raise ConfigError(
            "dpo.use_weighting=true: not with sft (TRL 1.16's DPOTrainer fails on it: its WPO weights "
            "multiply sft's loss in place, a RuntimeError)"
        )


def check_reference(config: Config, names: list[str]) -> None:
    settings = config.dpo
    if settings.reference not in REFERENCES:
        raise ConfigError(f"dpo.reference={settings.reference!r}: must be one of {', '.join(REFERENCES)}")
    adapters = lora.enabled(config.lora)
    sync = settings.sync_ref_model
    if not sync:
        for key in ("ref_model_mixup_alpha", "ref_model_sync_steps"):
            if getattr(settings, key) != getattr(DPOConfig, key):
                raise ConfigError(f"dpo.{key}={getattr(settings, key)} is set but dpo.sync_ref_model=false")
    if sync and adapters:
        raise ConfigError("dpo.sync_ref_model=true: not with LoRA (TRL's rule: its reference is no model)")
    if sync and not 0.0 <= settings.ref_model_mixup_alpha <= 1.0:
        raise ConfigError(f"dpo.ref_model_mixup_alpha={settings.ref_model_mixup_alpha}: must be in [0, 1]")
    if sync and settings.ref_model_sync_steps < 1:
        raise ConfigError(f"dpo.ref_model_sync_steps={settings.ref_model_sync_steps}: must be >= 1")
    if sync and settings.reference in ("precompute", "adapters_off"):
        raise ConfigError(
            f"dpo.reference={settings.reference}: dpo.sync_ref_model=true moves the reference, which needs "
            "dpo.reference=live"
        )
    if settings.reference == "adapters_off" and not adapters:
        raise ConfigError("dpo.reference=adapters_off: needs LoRA adapters (lora.r > 0 or lora.adapter)")
    if settings.reference == "adapters_off" and settings.ref_model:
        raise ConfigError(
            f"dpo.reference=adapters_off: the reference is the policy's base, not dpo.ref_model="
            f"{settings.ref_model}"
        )
    if settings.ref_model and os.path.isdir(settings.ref_model):
        if not os.path.isfile(os.path.join(settings.ref_model, "config.json")):
            raise ConfigError(
                f"dpo.ref_model={settings.ref_model!r}: no config.json in that folder (not a Hugging Face "
                "model folder)"
            )
    if dpo_loss.sorts_pairs(settings) and adapters and lora.resolve(config.lora).dropout > 0:
        raise ConfigError(
            f"dpo.loss_type={names}: needs the step's log-probs before its gradients, which lora.dropout "
            "would draw differently; set lora.dropout=0 (TRL's disable_dropout=true does)"
        )
    if settings.reference == "auto":  # resolved here, so config.yaml says which reference ran
        fresh = adapters and not config.lora.adapter and not settings.ref_model
        settings.reference = "live" if sync else "adapters_off" if fresh else "precompute"


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
