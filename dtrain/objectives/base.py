"""What every objective shares: the `Objective` a run's loop calls each step, the `Context` a run (or
a plan) builds it from, and the `ObjectiveSpec` that declares an objective to the runner.

An objective (SFT, DPO, ...) is one `ObjectiveSpec` in its own module of this folder: its config schema
and Hydra config, its embedded default, the data formats it trains on, its own checks before launch,
and how a run builds its `Objective`. The runner (dtrain/runner.py) and the trainer (dtrain/trainer.py)
take any spec; the entry points (dtrain/sft.py, dtrain/dpo.py) are a Hydra main each. docs/extending.md
says how to add one.

The loop calls an `Objective` in four places each step:
- `next_batches(step, read)`: this rank's micro-batches of the step, on its device; `read()` takes the
  next step of the data stream (SFT and DPO read one each step).
- `begin_step(micro_batches)`: before the step's first gradient: the step's global counts (what the
  loss is a mean over: supervised tokens, pairs), and the router's start of the step (a
  mixture-of-experts model; with its aux loss over the global batch, `moe.aux_scope=global_batch`,
  the step's routes counted first).
- `micro_step(micro_batch)`: forward, loss and backward of one micro-batch (the loss divided by the
  global count, so the gradients summed over micro-batches and ranks are the global batch's mean);
  its summed loss and figures accumulate, detached.
- `figures()` (a collective): the step's logged figures, reduced over the ranks: `loss`, `tokens`,
  the non-pad slots, and the objective's own (the router's `aux_loss` and `expert_load`; DPO's
  rewards).
- `end_step(step)`: after the optimizer step, before the step's checkpoint and eval.

The router's aux term lives here, behind every objective: its share of each micro-batch is added to
what is differentiated (each micro-step function takes the router) and its figures, with
coef · aux_loss added to the logged loss, come with every objective's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch

from dtrain.config import Config, MoeConfig, TrainConfig
from dtrain.data.formats import FORMATS
from dtrain.distributed import Parallel
from dtrain.loss import LossSettings, loss_context
from dtrain.parallel.router import RouterStats
from dtrain.step import local_micro_batch

HostBatches = list[dict[str, torch.Tensor]]  # one step of a rank's micro-batches, as the data stage made them


@dataclass
class StepFigures:
    """A step's logged figures, the same on every rank: its loss (what was differentiated, the aux
    term included), its supervised tokens, and the objective's own figures; with the counts of every
    step since the last logged one (throughput and padding are measured over them): supervised tokens,
    non-pad slots and slots (the rows the steps really held, every rank's)."""

    loss: float
    tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    supervised: float = 0.0
    filled: float = 0.0
    slots: float = 0.0


class Objective:
    """The parts every objective shares: the model, the mesh, the loss settings and the router."""

    def __init__(
        self, model: torch.nn.Module, parallel: Parallel, loss: LossSettings, moe: MoeConfig
    ) -> None:
        self.model, self.parallel, self.loss = model, parallel, loss
        # mixture of experts: routing figures and the aux loss (moe: its scope and padding)
        self.router = RouterStats.attach(model, parallel, moe)
        self.tokens = torch.zeros((), device=parallel.device)  # the step's supervised tokens
        # the step's non-pad slots and slots, every rank's (`count` sets them with `tokens`)
        self.filled = torch.zeros((), device=parallel.device)
        self.slots = torch.zeros((), device=parallel.device)
        # supervised tokens, non-pad slots and slots since the last logged step (on the device: no wait)
        self.interval = torch.zeros(3, device=parallel.device)
        self.frozen: list[torch.nn.Module] = []  # models it runs besides `model` (DPO's live reference)

    def next_batches(self, step: int, read: Callable[[], HostBatches]) -> list[dict[str, Any]]:
        """This rank's micro-batches of optimizer step `step` (from 0), on its device: the data
        stream's next step (`read()`), each micro-batch's part for this rank (context parallel)."""
        return [local_micro_batch(micro_batch, self.parallel) for micro_batch in read()]

    def begin_step(self, micro_batches: list[dict[str, Any]]) -> None:
        """The step's global counts (`count`), then the router's start of the step, whose counting
        forward (aux loss only) runs the objective's own forward."""
        self.count(micro_batches)
        self.interval += torch.stack([self.tokens, self.filled, self.slots])
        if self.router is not None:
            with loss_context(self.loss.parallel):
                self.router.begin_step(micro_batches, self.forward)

    def figures(self) -> StepFigures:
        """The step's figures (a collective: every rank calls it), with the counts since the last
        logged step (then started again)."""
        figures = self.reduce()
        figures.supervised, figures.filled, figures.slots = self.interval.tolist()
        self.interval.zero_()
        if self.router is not None:
            routing = self.router.figures()
            figures.loss += self.router.coef * routing.get("aux_loss", 0.0)  # the loss HF trains with
            figures.extra |= routing
        return figures

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        """The step's global counts: `tokens`, `filled` and `slots` (dtrain.step.global_counts), and
        what else the objective's loss is a mean over."""
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

    def end_step(self, step: int) -> None:
        """After step `step`'s optimizer step (from 1), before its checkpoint and eval (DPO's TR-DPO
        moves its reference there)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of the objective besides the model, the optimizer and the data;
        empty: nothing. The same keys at every call. A value holding tensors (DPO's TR-DPO reference:
        DTensors) is loaded in place and resharded to the run's mesh; any other value (GRPO's sampled
        generation) must be the same on every rank and not depend on the mesh: it is pickled whole."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict()` (called on resume only)."""

    def describe(self) -> str:
        """What the start line says of the objective (e.g. which reference DPO took); empty: nothing."""
        return ""


@dataclass
class Context:
    """What a run, a plan (dtrain.estimate) or the benchmark builds an objective from: the policy on
    its mesh, and what only some objectives use."""

    config: Config
    model: torch.nn.Module
    parallel: Parallel
    # A frozen model built and sharded like the policy (dtrain.model.build_frozen_model): frozen(None),
    # the starting policy; frozen(FOLDER), the Hugging Face model in FOLDER (DPO's reference, a teacher)
    frozen: Callable[[str | None], torch.nn.Module] | None = None
    data: Any = None  # the run's data (dtrain.data.pipeline.SFTData); None in a plan
    run_dir: Path | None = None
    step: int = 0  # where the run starts: 0, or the resumed checkpoint's step
    resume_from: Path | None = None  # the checkpoint folder resumed from
    # DPO's precompute table given whole (a plan, the benchmark); None: computed from `data` or read
    # from the run folder
    reference_table: Callable[[], torch.Tensor] | None = None


def no_checks(config: Config) -> None:
    """An objective without checks of its own."""


def no_model_checks(config: Config, model_config: Any, files: bool = True) -> None:
    """An objective without checks of the models it builds besides the policy."""


def nothing_resolved(config: Config, resolved: dict[str, Any]) -> None:
    """An objective that resolves no value of its own before launch."""


def rows_per_rank(config: Config, dp_rank: int, dp_size: int) -> tuple[TrainConfig, int, int]:
    """The data stream of an objective that trains on its rows: train.global_batch_size rows a step,
    each dp rank its share."""
    return config.train, dp_rank, dp_size


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective, declared: what the runner (dtrain/runner.py) needs to run it from its entry point."""

    name: str  # its entry point is dtrain.<name>
    schema: type[Config]  # its config schema: the training groups plus its own
    config_name: str  # its Hydra config, dtrain/conf/<config_name>.yaml
    embedded: str  # the override that adds its embedded default (hydra_glue.with_embedded_defaults)
    # the tokenized examples it trains on: the `features` of the formats it takes (dtrain/data/formats.py)
    features: datasets.Features
    build: Callable[[Context], Objective]  # its loss, for a run or a plan
    check: Callable[[Config], None] = no_checks  # its own group's checks, before launch (ConfigError)
    # its checks that need the policy's architecture (config, model_config, files: False when planning,
    # which reads no data and no weights), e.g. a teacher's vocabulary against the student's
    check_models: Callable[[Config, Any, bool], None] = no_model_checks
    # what config.yaml records of the values its checks resolved (e.g. dpo.reference=auto)
    record_resolved: Callable[[Config, dict[str, Any]], None] = nothing_resolved
    # how a run reads its data stream: (a TrainConfig whose batch sizes count the stream's rows, this
    # rank's dp rank and the dp size of the reading); dtrain.grpo reads whole generations of prompts
    stream: Callable[[Config, int, int], tuple[TrainConfig, int, int]] = rows_per_rank

    @property
    def formats(self) -> tuple[str, ...]:
        """The data formats it trains on (data.format): each one in FORMATS that writes its features."""
        return tuple(name for name, fmt in FORMATS.items() if fmt.features == self.features)
