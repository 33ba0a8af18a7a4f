"""Distillation's objective (dtrain.distill): the fused vocab-parallel divergence (dtrain/fused_divergence.py)
between the student and a frozen teacher built like it on the same mesh, on the data's completions
(offline, TRL 1.16's GKDTrainer at lmbda=0) or on completions the student samples (on-policy, TRL's
DistillationTrainer); docs/distill.md.

The loss of a step: Σ over its scored tokens (every completion token of every micro-batch of every dp
and cp rank) of the divergence at distill.temperature, plus distill.sft_weight × the student's NLL of
them on an offline step, divided by the step's scored-token count: the same on any mesh and
accumulation. Whether a step is on-policy is drawn per optimizer step from train.seed
(`on_policy_step`), so it does not depend on the mesh either.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from dtrain.config import Config, ConfigError, DistillationConfig, DistillConfig, ModelConfig, MoeConfig
from dtrain.data.completions import Completions
from dtrain.data.formats import COMPLETION_FEATURES, load_tokenizer
from dtrain.distributed import Parallel
from dtrain.fused_divergence import FIGURES, Divergence, FusedDivergence, Logits
from dtrain.loss import LossSettings, loss_context
from dtrain.model import has_weights, load_model_config, looks_local, tokenizer_source
from dtrain.objectives import distill_sampling as sampling
from dtrain.objectives.base import Context, HostBatches, Objective, ObjectiveSpec, StepFigures
from dtrain.parallel.parallelize import TP_PLANS, reshard
from dtrain.step import final_hidden_states, global_counts, local_micro_batch, model_inputs


def on_policy_step(seed: int, step: int, fraction: float) -> bool:
    """Whether optimizer step `step` (from 0) samples its completions: a draw from (seed, step) alone,
    the same on every rank and mesh; never at fraction 0, always at 1."""
    return random.Random(seed * 1_000_003 + step).random() < fraction


class DistillLoss(Objective):
    """Distillation (dtrain.distill): see the module's docstring. The teacher runs each micro-batch's
    forward without gradients, then the divergence takes both models' final hidden states and heads."""

    def __init__(
        self,
        model: torch.nn.Module,
        parallel: Parallel,
        loss: LossSettings,
        moe: MoeConfig,
        settings: DistillConfig,
        teacher: torch.nn.Module,
        seed: int,
        sampler: Callable[[int, HostBatches], HostBatches] | None = None,
    ) -> None:
        super().__init__(model, parallel, loss, moe)
        self.settings, self.teacher, self.seed, self.sampler = settings, teacher, seed, sampler
        self.frozen.append(teacher)
        teacher.eval()  # no dropout in the teacher (TRL's)
        self.logits = Logits.of(model.config), Logits.of(teacher.config)
        self.sampled = False  # whether this step's completions were sampled
        self.sums = torch.zeros(len(FIGURES), device=parallel.device)

    def next_batches(self, step: int, read: Callable[[], HostBatches]) -> list[dict[str, Any]]:
        """The step's micro-batches: the data's completions, or on an on-policy step the same prompts'
        sampled completions."""
        self.sampled = on_policy_step(self.seed, step, self.settings.on_policy)
        host = read()
        if self.sampled:
            assert self.sampler is not None, "an on-policy step needs a sampler"
            host = self.sampler(step, host)
        return [local_micro_batch(micro_batch, self.parallel) for micro_batch in host]

    def count(self, micro_batches: list[dict[str, Any]]) -> None:
        self.tokens, self.filled, self.slots = global_counts(micro_batches, self.parallel)
        self.sums = torch.zeros(len(FIGURES), device=self.parallel.device)
        nll_weight = 0.0 if self.sampled else self.settings.sft_weight  # the data's completions only
        settings = self.settings
        divergence = Divergence(settings.beta, settings.temperature, nll_weight, *self.logits)
        self.divergence = FusedDivergence(divergence, self.loss.chunk, self.model.config.vocab_size)

    def forward(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        hidden, _ = final_hidden_states(self.model, model_inputs(self.model, micro_batch))
        return hidden

    def micro_step(self, micro_batch: dict[str, Any]) -> None:
        recorded = self.router.record(micro_batch) if self.router is not None else contextlib.nullcontext()
        with loss_context(self.loss.parallel), recorded:
            with torch.no_grad():
                teacher_hidden, teacher_head = final_hidden_states(
                    self.teacher, model_inputs(self.teacher, micro_batch)
                )
            hidden, head = final_hidden_states(self.model, model_inputs(self.model, micro_batch))
            loss, sums = self.divergence(
                hidden, head.weight, teacher_hidden, teacher_head.weight, micro_batch["labels"]
            )
            # The divergence is done with the teacher (its gradients are computed in its forward): free
            # its hidden states, and its root (embedding and head), which FSDP keeps gathered after a
            # forward without backward, before the student's backward.
            del teacher_hidden, teacher_head
            reshard(self.teacher)
            total = loss / self.tokens
            aux = self.router.aux_term() if self.router is not None else None
            (total if aux is None else total + aux).backward()
        self.sums += sums

    def reduce(self) -> StepFigures:
        dist.all_reduce(self.sums, group=self.parallel.token_group)
        divergence, nll, entropy = (self.sums / self.tokens).tolist()
        figures: dict[str, Any] = {"entropy": entropy}
        if self.settings.on_policy:
            figures["on_policy"] = float(self.sampled)
        weight = 0.0 if self.sampled else self.settings.sft_weight
        if self.settings.sft_weight:
            figures |= {"divergence": divergence, "nll_loss": nll}
        return StepFigures(divergence + weight * nll, int(self.tokens.item()), figures)


def teacher_settings(settings: DistillConfig) -> ModelConfig:
    """The teacher as a model: its folder's weights and architecture."""
    return ModelConfig(name_or_path=settings.teacher, init="pretrained")


def build(context: Context) -> DistillLoss:
    """The divergence against the teacher (`context.frozen(distill.teacher)`: built like the policy)."""
    config = context.config
    settings = config.distill
    if context.frozen is None:
        raise ValueError("dtrain.distill: the objective needs a frozen model builder (Context.frozen)")
    if context.data is not None and settings.on_policy < 1:
        check_completions(context.data.train.rows.examples, settings.on_policy)
    sampler = None
    if settings.on_policy > 0:
        train = config.train
        rows = context.data.train.rows if context.data is not None else None
        if rows is not None:
            check_room(rows, config.data.max_len, settings.max_completion_length)
            tokenizer = load_tokenizer(tokenizer_source(config.model))
            engine = sampling.build_engine(config, context, tokenizer, train.global_batch_size)
            sampler = sampling.OnPolicy(engine, context.model, rows, context.parallel, train.micro_batch_size)
    teacher = context.frozen(settings.teacher)
    loss = LossSettings.of(config.parallel)
    return DistillLoss(
        context.model, context.parallel, loss, config.moe, settings, teacher, config.train.seed, sampler
    )


def check_room(rows: Completions, max_len: int, max_completion_length: int) -> None:
    """On-policy steps append up to max_completion_length sampled tokens to every prompt, which a row
    must hold (a prompt is never truncated: TRL's)."""
    lengths = [len(ids) for ids in rows.examples["prompt_ids"][:]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_completion_length > max_len:
        raise ConfigError(
            f"data example {longest}: its prompt of {lengths[longest]} tokens and "
            f"distill.max_completion_length={max_completion_length} do not fit data.max_len={max_len} (raise "
            f"data.max_len to at least {lengths[longest] + max_completion_length})"
        )


def check_completions(examples: Any, on_policy: float) -> None:
    """Offline steps train on the data's completions: every example needs one."""
    lengths = examples.with_format("numpy")["completion_ids"]
    for index, ids in enumerate(lengths):
        if len(ids) == 0:
            raise ConfigError(
                f"data example {index}: a prompt without a completion, which distill.on_policy={on_policy} "
                "needs for its offline steps (on_policy=1 samples every step's completions)"
            )


def check(config: Config) -> None:
    """distill.*'s values (the teacher's folder and architecture: check_models)."""
    settings = config.distill
    if not settings.teacher:
        raise ConfigError(
            "distill.teacher: required (a Hugging Face folder or hub id with the student's vocabulary)"
        )
    if not 0.0 <= settings.beta <= 1.0:
        raise ConfigError(
            f"distill.beta={settings.beta}: must be in [0, 1] (0 forward KL, 1 reverse KL, between: the JSD)"
        )
    if not settings.temperature > 0:
        raise ConfigError(f"distill.temperature={settings.temperature}: must be > 0")
    if settings.sft_weight < 0:
        raise ConfigError(f"distill.sft_weight={settings.sft_weight}: must be >= 0")
    if not 0.0 <= settings.on_policy <= 1.0:
        raise ConfigError(f"distill.on_policy={settings.on_policy}: must be in [0, 1] (a fraction of steps)")
    if settings.sft_weight and settings.on_policy == 1:
        raise ConfigError(
            f"distill.sft_weight={settings.sft_weight} with distill.on_policy=1: the NLL term is over the "
            "data's completions, which no step trains on"
        )
    if settings.num_generations != 1:
        raise ConfigError(
            f"distill.num_generations={settings.num_generations}: dtrain.distill samples one completion "
            "per prompt (TRL's DistillationTrainer)"
        )
    if settings.max_completion_length < 1:
        raise ConfigError(f"distill.max_completion_length={settings.max_completion_length}: must be >= 1")
    if settings.on_policy > 0:
        sampling.check(config)
    if config.parallel.loss_impl in ("dense", "chunked"):
        raise ConfigError(
            f"parallel.loss_impl={config.parallel.loss_impl}: dtrain.distill computes its divergence fused "
            "(parallel.loss_chunk positions at a time); leave parallel.loss_impl at auto"
        )
    config.parallel.loss_impl = "auto"  # fused is what runs; auto keeps a softcapped family's check quiet
    if config.train.eval_every:
        every = config.train.eval_every
        raise ConfigError(f"train.eval_every={every}: dtrain.distill has no eval yet (set 0)")


def check_models(config: Config, model_config: PretrainedConfig, files: bool = True) -> None:
    """The teacher against the student (`model_config`): its folder (with weights, unless planning:
    files=False reads a hub id's shipped architecture), the same vocabulary, a family the divergence
    takes at this tp (a TP plan at tp > 1; lm_head's logits computed by dtrain at any tp)."""
    settings, tp = config.distill, config.parallel.tp
    key = f"distill.teacher={settings.teacher!r}"
    teacher = settings.teacher
    if files and looks_local(teacher) and not os.path.isdir(os.path.expanduser(teacher)):
        raise ConfigError(f"{key}: no such folder")
    if os.path.isdir(teacher) and not os.path.isfile(os.path.join(teacher, "config.json")):
        raise ConfigError(f"{key}: no config.json in that folder (a Hugging Face model folder)")
    try:
        teacher_config = load_model_config(teacher_settings(settings), offline=not files)
    except ConfigError as error:  # it names model.name_or_path: name the teacher's key instead
        raise ConfigError(str(error).replace("model.name_or_path", "distill.teacher")) from None
    if files and not has_weights(teacher):
        raise ConfigError(f"{key}: no *.safetensors weights (a teacher needs its trained weights)")
    if teacher_config.vocab_size != model_config.vocab_size:
        raise ConfigError(
            f"{key}: its vocabulary has {teacher_config.vocab_size} ids, the student's "
            f"({config.model.name_or_path or 'model.config'}) {model_config.vocab_size}; a teacher needs "
            "the student's tokenizer and vocabulary"
        )
    for name, family in ((key, teacher_config), ("model.name_or_path", model_config)):
        if family.model_type in TP_PLANS:
            continue
        if tp > 1:  # the student's own refusal (checks.check_tp_support) says the same of it
            raise ConfigError(
                f"{name}: model type {family.model_type!r} has no TP plan, so it runs with parallel.tp=1 "
                f"only; parallel.tp={tp} needs one of: {', '.join(TP_PLANS)}"
            )
        raise ConfigError(
            f"{name}: model type {family.model_type!r}: dtrain.distill computes lm_head's logits itself, "
            f"checked for {', '.join(TP_PLANS)} only"
        )
    for attribute in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(teacher_config, attribute, None)
        if value is not None and value % tp:
            raise ConfigError(f"{key}: its {attribute}={value} is not divisible by parallel.tp={tp}")


def record_resolved(config: Config, resolved: dict[str, Any]) -> None:
    resolved["parallel"]["loss_impl"] = "fused"  # config.yaml shows what ran: the fused divergence


SPEC = ObjectiveSpec(
    name="distill",
    schema=DistillationConfig,
    config_name="config_distill",
    embedded="+experiment=embedded_distill",
    features=COMPLETION_FEATURES,
    build=build,
    check=check,
    check_models=check_models,
    record_resolved=record_resolved,
)
