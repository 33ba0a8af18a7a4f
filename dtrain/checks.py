"""Every check a config must pass before launch: the cross-checks that need the world size and the
model's architecture (divisibility, allowed values, supported families and losses, files), on top of
the types and keys Hydra checks against the schema (dtrain/config.py). Both run on every rank before
`init_process_group`, so a bad config fails everywhere at once, with one line naming the key,
instead of hanging a collective."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from dtrain.config import (
    Config,
    ConfigError,
    DataConfig,
    EstimateConfig,
    LoraConfig,
    MeshShape,
    ParallelConfig,
    TrainConfig,
)
from dtrain.data.formats import FORMATS
from dtrain.objectives import check_objective, objective_of
from dtrain.parallel import experts, lora
from dtrain.parallel.parallelize import TP_PLANS, check_tp_divides, check_tp_support, decoder_layers

SWEEP_ON_FAILURE = ("continue", "stop")
PRECISIONS = ("bf16", "fp32")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
RESHARD_AFTER_FORWARD = ("auto", "always", "never")
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
WANDB_MODES = ("online", "offline", "disabled")
ESTIMATE_FORMATS = ("table", "json")
EXPORT_DTYPES = ("bf16", "fp32")
OVERLONG = ("truncate", "drop")
LOSS_IMPLS = ("auto", "dense", "chunked", "fused")
MODEL_INITS = ("auto", "pretrained", "random")
AUX_SCOPES = ("micro_step", "global_batch")
# What marks data.path as meant to be local (so a typo is "no such file", not a failed hub lookup).
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(allowed)}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}={value}: must be >= 1")


def mesh_shape(parallel: ParallelConfig, world_size: int) -> MeshShape:
    """Resolve dp_shard=-1 and check that the product of the degrees is the world size."""
    fixed = {"tp": parallel.tp, "cp": parallel.cp, "dp_replicate": parallel.dp_replicate}
    for axis, degree in fixed.items():
        _positive(f"parallel.{axis}", degree)
    others = math.prod(fixed.values())
    named = " × ".join(f"parallel.{axis}={degree}" for axis, degree in fixed.items() if degree > 1)
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(f"{named} does not divide the world size {world_size}")
        dp_shard = world_size // others
    _positive("parallel.dp_shard", dp_shard)
    if others * dp_shard != world_size:
        product = " × ".join(filter(None, [named, f"parallel.dp_shard={dp_shard}"]))
        raise ConfigError(f"{product} = {others * dp_shard}, but the world size is {world_size}")
    _positive("parallel.ep", parallel.ep)
    if (dp_shard * parallel.cp) % parallel.ep:
        raise ConfigError(
            f"parallel.ep={parallel.ep} must divide the ranks FSDP shards over: "
            f"parallel.dp_shard={dp_shard} × parallel.cp={parallel.cp} = {dp_shard * parallel.cp}"
        )
    return MeshShape(parallel.dp_replicate, dp_shard, parallel.cp, parallel.tp, parallel.ep)


def _check_source_path(key: str, path: str) -> None:
    """Local paths must exist; anything else is taken for a hub id and resolved when loading."""
    looks_local = path.startswith(("/", "./", "../", "~")) or path.endswith(LOCAL_SUFFIXES)
    if looks_local and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{key}={path!r}: no such file or folder")


def check_data(data: DataConfig, train: TrainConfig, *, files: bool = True) -> None:
    _one_of("data.overlong", data.overlong, OVERLONG)
    _positive("data.num_proc", data.num_proc)
    if data.num_workers < 0:
        raise ConfigError(f"data.num_workers={data.num_workers}: must be >= 0")
    check_format("data.format", data.format)
    if data.max_samples is not None:
        _positive("data.max_samples", data.max_samples)
    if data.mix:
        for source in data.sources():
            if files:
                _check_source_path(source.key("path"), source.path)
            if not source.weight > 0:
                raise ConfigError(f"{source.key('weight')}={source.weight}: must be > 0")
            check_format(source.key("format"), source.format)
            if source.max_samples is not None:
                _positive(source.key("max_samples"), source.max_samples)
    elif files:
        _check_source_path("data.path", data.path)
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction}: must be in [0, 1)")
    if data.eval_split is not None and data.eval_fraction > 0:
        raise ConfigError("data.eval_split and data.eval_fraction: set one of them, not both")
    if train.eval_every < 0:
        raise ConfigError(f"train.eval_every={train.eval_every}: must be >= 0")
    if train.eval_every and data.eval_split is None and data.eval_fraction == 0:
        raise ConfigError(
            f"train.eval_every={train.eval_every} needs an eval set: "
            "set data.eval_split or data.eval_fraction"
        )


def check_config(config: Config, world_size: int, model_config: Any, *, files: bool = True) -> MeshShape:
    """Every cross-check that can fail before launch. Returns the resolved mesh shape.
    files=False skips what only a training run reads from disk (data.path): the planner needs none."""
    shape = mesh_shape(config.parallel, world_size)
    train, data, parallel = config.train, config.data, config.parallel

    _one_of("train.precision", train.precision, PRECISIONS)
    _one_of("train.nonfinite", train.nonfinite, ("skip", "abort"))
    _one_of("train.sweep_on_failure", train.sweep_on_failure, SWEEP_ON_FAILURE)
    _one_of("parallel.activation_checkpointing", parallel.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _one_of("optim.schedule", config.optim.schedule, SCHEDULES)
    _one_of("parallel.loss_impl", parallel.loss_impl, LOSS_IMPLS)
    _one_of("parallel.reshard_after_forward", parallel.reshard_after_forward, RESHARD_AFTER_FORWARD)
    if parallel.fsdp_prefetch < 0:
        raise ConfigError(
            f"parallel.fsdp_prefetch={parallel.fsdp_prefetch}: must be >= 0 (0: FSDP's own prefetching)"
        )
    _one_of("logging.wandb.mode", config.logging.wandb.mode, WANDB_MODES)
    _one_of("model.init", config.model.init, MODEL_INITS)
    _one_of("moe.aux_scope", config.moe.aux_scope, AUX_SCOPES)
    for key, value in (
        ("train.max_steps", train.max_steps),
        ("train.global_batch_size", train.global_batch_size),
        ("train.micro_batch_size", train.micro_batch_size),
        ("train.log_every", train.log_every),
        ("data.max_len", data.max_len),
        ("parallel.timeout_s", parallel.timeout_s),
    ):
        _positive(key, value)
    if train.epochs is not None and not train.epochs > 0:
        raise ConfigError(f"train.epochs={train.epochs}: must be > 0")
    if train.max_skips < 0:
        raise ConfigError(f"train.max_skips={train.max_skips}: must be >= 0")
    if config.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={config.optim.warmup_steps}: must be >= 0")

    per_step = train.micro_batch_size * shape.dp
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={train.micro_batch_size} × dp={shape.dp} (= {per_step})"
        )
    check_data(data, train, files=files)
    objective = objective_of(config)
    check_objective(config, objective)
    objective.check_models(config, model_config, files)
    check_sequence_split(data.max_len, shape, parallel.sequence_parallel)
    if config.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={config.checkpoint.every}: must be >= 0 (0: final save only)")
    _positive("checkpoint.keep", config.checkpoint.keep)
    _one_of("checkpoint.export_dtype", config.checkpoint.export_dtype, EXPORT_DTYPES)
    if not (config.model.tokenizer or config.model.name_or_path):
        raise ConfigError("model.tokenizer: needed when model.name_or_path is not set")

    check_tp_support(model_config.model_type, shape.tp)
    check_expert_parallel(model_config, shape, parallel)
    if parallel.loss_impl == "auto":  # resolved here, so config.yaml and the planner see what runs
        parallel.loss_impl = auto_loss_impl(model_config)
    check_loss_support(model_config, parallel.loss_impl)
    check_lora_off(config.lora)
    if lora.enabled(config.lora):
        check_lora(config.lora, model_config, train.precision)
    if parallel.loss_impl in ("chunked", "fused") and parallel.loss_chunk < 1:
        raise ConfigError(
            f"parallel.loss_chunk={parallel.loss_chunk}: must be >= 1 "
            f"with parallel.loss_impl={parallel.loss_impl}"
        )
    check_tp_divides(model_config, shape.tp)
    return shape


def check_sequence_split(max_len: int, shape: MeshShape, sequence_parallel: bool) -> None:
    """Context parallel cuts each row into 2·cp equal chunks (rank i keeps chunks i and 2·cp-1-i, so
    causal work is even); sequence parallel then splits a rank's part over tp."""
    chunks = 2 * shape.cp if shape.cp > 1 else 1
    split = chunks * (shape.tp if sequence_parallel else 1)
    if max_len % split == 0:
        return
    parts = []
    if shape.cp > 1:
        parts.append(f"2 × parallel.cp={shape.cp} (context parallel's chunks)")
    if sequence_parallel and shape.tp > 1:
        parts.append(f"parallel.tp={shape.tp} (sequence parallel; or set parallel.sequence_parallel=false)")
    total = f" = {split}" if len(parts) > 1 else ""
    raise ConfigError(f"data.max_len={max_len} is not divisible by {' × '.join(parts)}{total}")


def check_format(key: str, name: str) -> None:
    _one_of(key, name, tuple(FORMATS))


def check_expert_parallel(model_config: Any, shape: MeshShape, parallel: ParallelConfig) -> None:
    """parallel.ep > 1 needs a family whose experts transformers stacks (experts.STACKED_EXPERTS) and
    an expert count it divides; such a family at tp > 1 needs sequence parallel (each tp rank routes
    its own tokens) and experts in every layer (its plan has no dense MLP styles)."""
    stacked = model_config.model_type in experts.STACKED_EXPERTS
    if shape.ep > 1 and not stacked:
        raise ConfigError(
            f"parallel.ep={shape.ep}: model type {model_config.model_type!r} has no stacked experts "
            f"dtrain can split; expert parallel takes {', '.join(experts.STACKED_EXPERTS)}"
        )
    if not stacked:
        return
    jitter = getattr(model_config, "router_jitter_noise", 0.0)
    if jitter:
        raise ConfigError(
            f"model router_jitter_noise={jitter}: random noise on the router's input is not supported "
            "(set +model.config.router_jitter_noise=0)"
        )
    quantization = getattr(model_config, "quantization_config", None)
    if quantization:  # GPT-OSS's published experts are MXFP4
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ConfigError(
            f"model quantization_config ({method}): dtrain trains unquantized weights; "
            "use a bf16 or fp32 copy of the checkpoint"
        )
    count = experts.num_experts(model_config)
    if count % shape.ep:
        raise ConfigError(f"parallel.ep={shape.ep} does not divide the model's {count} experts")
    if shape.tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            f"parallel.tp={shape.tp} with a mixture-of-experts model needs parallel.sequence_parallel=true "
            "(each tp rank routes its own part of the sequence)"
        )
    dense_layers = (
        getattr(model_config, "mlp_only_layers", None) or getattr(model_config, "decoder_sparse_step", 1) != 1
    )
    if shape.tp > 1 and dense_layers:
        raise ConfigError(
            f"parallel.tp={shape.tp}: the model has dense MLP layers among its expert layers "
            "(mlp_only_layers, decoder_sparse_step), which the mixture-of-experts plans do not cover yet"
        )


def check_lora_off(settings: LoraConfig) -> None:
    """lora.r below 0, or 0 (LoRA off, a full fine-tune) beside another lora key set: a typo would
    otherwise train every parameter without a word."""
    if settings.r < 0:
        raise ConfigError(f"lora.r={settings.r}: must be >= 0 (0: LoRA off, every parameter trains)")
    if settings.r > 0 or settings.adapter:
        return
    default = LoraConfig()
    for item in dataclasses.fields(LoraConfig):
        value = getattr(settings, item.name)
        if value != getattr(default, item.name):
            raise ConfigError(
                f"lora.{item.name}={value} is set but lora.r=0 (LoRA off: every parameter trains); "
                "set lora.r to train adapters"
            )


def check_lora(settings: LoraConfig, model_config: Any, precision: str) -> None:
    """lora.*: values in range, the adapter folder readable, every target module a Linear of the
    decoder layers (read off the model built on the meta device)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    settings = lora.resolve(settings)
    _positive("lora.r", settings.r)
    if not 0.0 <= settings.dropout < 1.0:
        raise ConfigError(f"lora.dropout={settings.dropout}: must be in [0, 1)")
    _one_of("lora.init", settings.init, ("default", "gaussian"))
    _one_of("lora.base_dtype", settings.base_dtype, ("auto", "bf16", "fp32", "nf4"))
    if settings.base_dtype == "bf16" and precision != "bf16":
        raise ConfigError("lora.base_dtype=bf16 needs train.precision=bf16 (FSDP gathers one dtype)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config))
    lora.check_targets(model, decoder_layers(model), settings.target_modules)


def auto_loss_impl(model_config: Any) -> str:
    """parallel.loss_impl=auto: `fused` (the lowest-memory loss: one chunk of logits alive) wherever
    check_loss_support allows it, which is where it is exact; `dense` elsewhere."""
    try:
        check_loss_support(model_config, "fused")
    except ConfigError:
        return "dense"
    return "fused"


def check_loss_support(model_config: Any, loss_impl: str) -> None:
    """chunked and fused compute the logits as lm_head(hidden) themselves, in place of the model's
    own head forward: right for the families with a TP plan (a bias-free lm_head and nothing after
    it), not for a head of another name (gpt_neox's embed_out) or logits post-processed (Granite's
    logits_scaling, a final softcap). Those train with the dense loss, the model's own logits."""
    if loss_impl == "dense":
        return
    model_type = model_config.model_type
    if model_type not in TP_PLANS:
        raise ConfigError(
            f"parallel.loss_impl={loss_impl}: computes lm_head's logits itself, checked for "
            f"{', '.join(TP_PLANS)} only; model type {model_type!r} trains with parallel.loss_impl=dense"
        )
    for key, plain in (("logits_scaling", 1.0), ("final_logit_softcapping", None)):
        value = getattr(model_config, key, plain)
        if value != plain:
            raise ConfigError(
                f"parallel.loss_impl={loss_impl}: the model's {key}={value} post-processes the logits, "
                "which the chunked and fused losses skip; use parallel.loss_impl=dense"
            )


def check_estimate(settings: EstimateConfig) -> None:
    """The `estimate` group's own checks (the rest of the config goes through check_config)."""
    _positive("estimate.world_size", settings.world_size)
    _positive("estimate.top_modules", settings.top_modules)
    _one_of("estimate.format", settings.format, ESTIMATE_FORMATS)
    if settings.gpu_memory_gib <= 0:
        raise ConfigError(f"estimate.gpu_memory_gib={settings.gpu_memory_gib}: must be > 0")
