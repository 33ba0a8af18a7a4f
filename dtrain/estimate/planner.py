"""Plan one experiment: the trainer's own model, parallelize and step, run on fake tensors with a
fake process group of `world_size` ranks, measured by torch's FSDPMemTracker. No figure of dtrain's
comes from a formula here; only the DeepSpeed comparison (deepspeed.py) is analytic.

Plans are for GPUs: packed rows, sliding windows and context parallel attend through CUDA's kernel,
flex attention with a block mask (on fake tensors: its outputs and gradients, no scores matrix),
not through the dense [batch, 1, local, seq] mask that sdpa takes on a CPU."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtrain import collector
from dtrain.attention import config_window
from dtrain.checks import check_config
from dtrain.config import Config, ConfigError, MeshShape
from dtrain.distributed import build_parallel
from dtrain.estimate.deepspeed import ParamCensus, census
from dtrain.estimate.measure import StepMemory, rollout_inputs, step_inputs, track_step, tracked_micro_batches
from dtrain.model import allocate, build_frozen_model, build_meta_model, build_model, load_model_config
from dtrain.objectives import Context, build_objective, objective_of
from dtrain.optim import build_optimizer
from dtrain.parallel import lora
from dtrain.parallel.context import shard_sequence
from dtrain.parallel.experts import experts_modules, local_weights
from dtrain.step import optimizer_step, with_filled_slots

CPU = torch.device("cpu")
# The attention kernel a CUDA run takes (dtrain.attention.backend_for); "sdpa" plans what a CPU run
# allocates (the tests compare the planner with a real gloo run).
CUDA_ATTENTION = "flex"


@dataclass
class Plan:
    """Per-rank bytes of one experiment on one mesh (rank 0 stands for all: shards are even)."""

    model_type: str
    num_params: int
    shape: MeshShape
    micro_batch_size: int  # rows; dtrain.dpo: pairs (two rows each)
    max_len: int
    precision: str
    activation_checkpointing: str
    attention: str  # the attention kernel planned: flex (CUDA's, for packed rows, windows, cp) or sdpa
    accumulation: int  # micro-batches per optimizer step
    loss_impl: str  # parallel.loss_impl as planned (auto resolved by check_config)
    objective: str  # `sft`, `dpo (reference=MODE)`, `grpo (...)`, `distill (teacher=NAME)`
    step: StepMemory
    # embedding / lm_head / experts (all layers): bytes on this rank and in all; experts also the
    # bytes a layer computes with on this rank (_computed_expert_bytes)
    layers: dict[str, dict[str, int]]
    tied: bool  # lm_head.weight is the embedding's
    census: ParamCensus  # the unsharded parameter counts, for the analytic comparison
    seconds: float


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Rank 0 of `world_size` ranks, with collectives that move nothing (torch's fake backend)."""
    if dist.is_initialized():
        raise RuntimeError("dtrain.estimate needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _quiet_dtensor() -> None:
    """DTensor warns once per op about sequential all-reduces over (dp, tp); they move nothing here."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@contextlib.contextmanager
def dtensor_meta_in_own_fake_mode() -> Iterator[None]:
    """DTensor computes output metadata (loss_parallel's handlers do, on every call) by running the
    op on fake full-size tensors in the *active* fake mode, or in a fresh one when there is none.
    In a real run that fresh mode makes FSDPMemTracker skip those tensors; under the planner's fake
    mode they would be counted as real ones (a full-vocabulary gradient in nll_loss_backward). Run
    that metadata pass outside the planner's mode, as in a real run."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    original = propagator._propagate_tensor_meta_non_cached

    def outside_planner_mode(op_schema):  # noqa: ANN001, ANN202 (torch's private signature)
        with unset_fake_temporarily():
            return original(op_schema)

    propagator._propagate_tensor_meta_non_cached = outside_planner_mode
    try:
        yield
    finally:
        del propagator._propagate_tensor_meta_non_cached  # back to the class's method


def masked_attention(config: Config, shape: MeshShape, model_config: object) -> bool:
    """Whether attention takes a mask beyond plain causal (packed rows, a sliding window shorter than
    max_len, context parallel): then the backend decides the kernel; plain causal rows take sdpa."""
    window = config_window(model_config, config.data.max_len)
    return config.data.packing or shape.cp > 1 or window is not None


def _layer_bytes(model: nn.Module, computed: dict[str, int]) -> dict[str, dict[str, int]]:
    out = {}
    pairs = (("embedding", model.get_input_embeddings()), ("lm_head", model.get_output_embeddings()))
    for name, module in pairs:
        weight = module.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        out[name] = {
            "local": local.untyped_storage().nbytes(),
            "total": weight.numel() * weight.element_size(),
        }
    return out | _expert_bytes(model, computed)


def _expert_bytes(model: nn.Module, computed: dict[str, int]) -> dict[str, dict[str, int]]:
    """A mixture-of-experts model's stacked expert weights, all layers: this rank's bytes (split over
    ep and efsdp) and all, and the most any layer computed with (`computed`); {} for a dense model."""
    params = [p for _, module in experts_modules(model) for p in module.parameters(recurse=False)]
    if not params:
        return {}
    local = sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in params)
    total = sum(p.numel() * p.element_size() for p in params)
    return {"experts": {"local": local, "total": total, "computed_per_layer": max(computed.values())}}


@contextlib.contextmanager
def _computed_expert_bytes(model: nn.Module) -> Iterator[dict[str, int]]:
    """Bytes of the expert weights (and biases) each experts module computes with on this rank, by
    module name: what its forward reads, after FSDP's all-gather (unsharded over efsdp, or over all of
    dp_shard × cp at ep = 1; in the compute dtype), split over ep. The persistent shards are the same
    at every ep (FSDP shards the rest); this is what ep divides."""
    computed: dict[str, int] = {}

    def record(name: str):  # noqa: ANN202 (a hook factory)
        def hook(module: nn.Module, args: tuple) -> None:
            weights = local_weights(module)  # FSDP's pre-forward hook (prepended) has unsharded them
            tensors = (weights.gate_up, weights.down, weights.gate_up_bias, weights.down_bias)
            computed[name] = sum(t.numel() * t.element_size() for t in tensors if t is not None)

        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in experts_modules(model)]
    try:
        yield computed
    finally:
        for handle in handles:
            handle.remove()


def allocated(model: nn.Module) -> nn.Module:
    allocate(model, CPU)  # the values do not matter
    return model


def plan(config: Config, world_size: int, attention_backend: str = CUDA_ATTENTION) -> Plan:
    """Build, shard and step the experiment on fake tensors; raises ConfigError for configs that
    cannot run on `world_size` ranks (the same checks as training, minus the data file). Context
    parallel takes the trainer's path: each micro-batch sharded over cp (shard_sequence), K and V
    all-gathered in attention (moving nothing on the fake process group)."""
    start = time.perf_counter()
    _quiet_dtensor()
    # Fake tensors make many short-lived objects; the cycle collector would cost a third of the run
    # (the tracker sees frees through weak references, which reference counting alone triggers).
    with collector.paused():
        return _plan(config, world_size, start, attention_backend)


def _plan(config: Config, world_size: int, start: float, attention_backend: str) -> Plan:
    model_config = load_model_config(config.model, offline=True)
    shape = check_config(config, world_size, model_config, files=False)
    train = config.train
    accumulation = train.global_batch_size // (train.micro_batch_size * shape.dp)
    with fake_process_group(world_size):
        parallel = build_parallel(shape, CPU)  # the mesh, outside the fake mode (it holds real rank ids)
        params_census = census(build_meta_model(model_config))  # the real vocabulary, as DeepSpeed's
        # The eager model is planned: torch.compile does not run under fake tensors and a fake
        # process group (it crashes), and fused kernels only lower the activation figures. A mixture
        # of experts' aux loss is planned at moe.aux_scope=micro_step (the default; global_batch's
        # extra forward, without gradients, holds less than the step's).
        eager = dataclasses.replace(
            config,
            parallel=dataclasses.replace(config.parallel, compile=False),
            moe=dataclasses.replace(config.moe, aux_scope="micro_step"),
        )
        model = build_model(model_config, eager, parallel, None, attention_backend=attention_backend)
        # a frozen model built as the trainer builds it (allocated below): dpo.reference=live's (the
        # starting policy, or dpo.ref_model's, its architecture read offline as the policy's), or
        # dtrain.grpo's reference at beta != 0 (a frozen copy of the starting policy)
        online = objective_of(config).name == "grpo"
        live = config.data.preference and config.dpo.reference == "live"
        reference = None
        if live or (online and grpo_reference(config) == "frozen copy"):
            folder = config.dpo.ref_model if live else None
            reference = build_frozen_model(
                eager, parallel, None, folder, model_config, None, attention_backend, offline=True
            )
        # dtrain.distill: its teacher, built as the trainer builds it (allocated below)
        teacher = None
        if config.data.completions:
            folder = config.distill.teacher
            teacher = build_frozen_model(
                eager, parallel, None, folder, model_config, None, attention_backend, offline=True
            )
        # The meta parameters become fake ones on to_empty: allow_non_fake_inputs lets that happen.
        with FakeTensorMode(allow_non_fake_inputs=True), dtensor_meta_in_own_fake_mode():
            allocated(model).train()
            optimizer = build_optimizer(model, config.optim)
            params = list(model.parameters())
            pairs = config.data.preference  # dtrain.dpo: micro-batches of pairs, two rows each
            if online:  # dtrain.grpo: micro-batches of completions, with the per-token log-probs it reads
                inputs = rollout_inputs(
                    train.micro_batch_size,
                    config.data.max_len,
                    min(config.grpo.max_completion_length, config.data.max_len - 1),
                    accumulation,
                    CPU,
                    grpo_tokens(config),
                )
            else:
                inputs = step_inputs(train.micro_batch_size, config.data.max_len, accumulation, CPU, pairs)
            micro_batches = [shard_sequence(with_filled_slots(mb), parallel["cp"]) for mb in inputs]
            objective = build_objective(
                Context(
                    eager,
                    model,
                    parallel,
                    frozen=lambda folder: allocated(teacher if teacher is not None else reference),
                    reference_table=lambda: torch.zeros(train.micro_batch_size, 2),  # precompute: no model
                )
            )
            # Warm-up: DTensor's first run of each op, and AdamW's states, before measuring.
            with _computed_expert_bytes(model) as computed:  # hooks only here: nothing in the tracker
                objective.begin_step(micro_batches[:1])
                objective.micro_step(micro_batches[0])
            optimizer_step(optimizer, params, config.optim.max_grad_norm)
            run = tracked_micro_batches(accumulation)
            step = track_step(model, optimizer, micro_batches, objective, config.optim.max_grad_norm, run)
            layers = _layer_bytes(model, computed)
    if online:
        add_generator(step, *generator_memory(config, model_config, params_census.total, shape))
    return Plan(
        model_type=model_config.model_type,
        num_params=params_census.total,
        shape=shape,
        micro_batch_size=train.micro_batch_size,
        max_len=config.data.max_len,
        precision=train.precision,
        activation_checkpointing=config.parallel.activation_checkpointing,
        attention=attention_backend if masked_attention(config, shape, model_config) else "sdpa",
        accumulation=accumulation,
        loss_impl=config.parallel.loss_impl,
        objective=objective_label(config, online),
        step=step,
        layers=layers,
        tied=bool(model_config.tie_word_embeddings),
        census=params_census,
        seconds=time.perf_counter() - start,
    )


def objective_label(config: Config, online: bool) -> str:
    if online:
        return f"grpo (reference: {grpo_reference(config)}, rollout.engine={config.rollout.engine})"
    if config.data.preference:
        return f"dpo (reference={config.dpo.reference})"
    if config.data.completions:
        return f"distill (teacher={config.distill.teacher})"
    return "sft"


def grpo_reference(config: Config) -> str:
    """dtrain.grpo's reference model: none (β = 0), the adapters off (LoRA from fresh adapters), or a
    frozen copy of the starting policy (dtrain.objectives.grpo.build)."""
    if config.grpo.beta == 0.0:
        return "none"
    return "adapters off" if lora.enabled(config.lora) and not config.lora.adapter else "frozen copy"


def grpo_tokens(config: Config) -> tuple[str, ...]:
    """The per-token log-probs dtrain.grpo's micro-batches carry (dtrain.objectives.grpo.add_logps)."""
    settings = config.grpo
    old = settings.steps_per_generation * settings.num_iterations > 1 or config.rollout.engine == "vllm"
    return (("old_logps",) if old else ()) + (("ref_logps",) if settings.beta != 0.0 else ())


def generator_memory(
    config: Config, model_config: object, num_params: int, shape: MeshShape
) -> tuple[int, int]:
    """dtrain.grpo's generator on one rank, counted (generate and vLLM do not run on fake tensors):
    (held through the training step, added while sampling). `hf`: the plain copy of the policy in the
    compute dtype (every parameter, unsharded) held, and while sampling one prompt's G completions
    at once (dtrain/rollout/hf.py) their KV cache over data.max_len positions (2 × layers × G × KV
    heads × head dim × max_len in the compute dtype) and the last position's fp32 logits (G × vocab).
    `vllm`: rollout.vllm_gpu_memory_utilization of estimate.gpu_memory_gib, held (sleep mode: only
    while sampling)."""
    rollout, settings = config.rollout, config.grpo
    if rollout.engine == "vllm":
        share = round(rollout.vllm_gpu_memory_utilization * config.estimate.gpu_memory_gib * 2**30)
        return (0, share) if rollout.vllm_enable_sleep_mode else (share, 0)
    if rollout.engine != "hf":  # file: nothing sampled
        return 0, 0
    width = 2 if config.train.precision == "bf16" else 4
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    group = settings.num_generations
    cache = 2 * model_config.num_hidden_layers * group * kv_heads * head_dim * config.data.max_len * width
    return num_params * width, cache + group * model_config.vocab_size * 4


def add_generator(step: StepMemory, held: int, sampling: int) -> None:
    """The generator's memory into the plan: held through the step (at its peak), and the sampling
    phase (the model state between steps, the reference, the generator) when that is higher."""
    step.generator, step.train_peak = held, step.peak + held
    step.generation_peak = step.params + step.optimizer + step.reference + held + sampling
    if step.generation_peak > step.train_peak:
        step.peak_phase = "generation (the generator sampling; counted)"
        step.at_peak = dict.fromkeys(step.at_peak, 0) | {
            "params": step.params,
            "optimizer": step.optimizer,
            "reference": step.reference,
        }
        step.at_peak["generator"] = held + sampling
        step.peak = step.generation_peak
    else:
        step.at_peak["generator"] = held
        step.peak += held


@dataclass
class Suggestion:
    change: str  # the overrides, as on the command line
    plan: Plan
    fits: bool


def _variant(config: Config, **changes: dict[str, object]) -> Config:
    variant = copy.deepcopy(config)
    for group, values in changes.items():
        for key, value in values.items():
            setattr(getattr(variant, group), key, value)
    return variant


def _doubling(config: Config, world_size: int, axis: str) -> list[tuple[str, Config]]:
    """parallel.<axis> doubled while it divides the world, dp_shard the rest (check_config, run by
    plan, ends the lever where the mesh, the model or max_len no longer allow it)."""
    degree, candidates = getattr(config.parallel, axis) * 2, []
    while world_size % degree == 0:
        change = f"parallel.{axis}={degree}"
        candidates.append((change, _variant(config, parallel={axis: degree, "dp_shard": -1})))
        degree *= 2
    return candidates


def suggest(
    config: Config, world_size: int, budget: int, attention_backend: str = CUDA_ATTENTION
) -> list[Suggestion]:
    """What would fit in `budget` bytes, each lever on its own and each candidate planned in full:
    activation checkpointing, smaller micro batches, more tp, more cp (long rows: each rank holds a
    cp-th of every row's tokens), more ep (each rank holds an ep-th of a mixture's experts). Per lever
    the first candidate that fits is kept, else the last one tried (so the report says how far it
    gets)."""
    levers: list[list[tuple[str, Config]]] = []
    if config.parallel.activation_checkpointing == "none":
        full = _variant(config, parallel={"activation_checkpointing": "full"})
        levers.append([("parallel.activation_checkpointing=full", full)])
    micro, candidates = config.train.micro_batch_size // 2, []
    while micro >= 1:
        candidates.append(
            (f"train.micro_batch_size={micro}", _variant(config, train={"micro_batch_size": micro}))
        )
        micro //= 2
    levers.append(candidates)
    levers.append(_doubling(config, world_size, "tp"))
    levers.append(_doubling(config, world_size, "cp"))
    levers.append(_doubling(config, world_size, "ep"))  # a dense model: check_config ends it at once

    suggestions = []
    for candidates in levers:
        last = None
        for change, variant in candidates:
            try:
                candidate = plan(variant, world_size, attention_backend)
            except ConfigError:  # e.g. tp no longer divides the heads: this lever ends here
                break
            last = Suggestion(change, candidate, candidate.step.peak <= budget)
            if last.fits:
                break
        if last is not None:
            suggestions.append(last)
    return suggestions
