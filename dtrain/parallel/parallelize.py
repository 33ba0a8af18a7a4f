"""Apply, in this order: tensor parallel (every parameter covered) → re-tie embeddings →
activation checkpointing → FSDP2 per decoder layer and root. Then check that every parameter is a
DTensor on the one mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from dtrain.config import ParallelConfig
from dtrain.distributed import Parallel
from dtrain.parallel import llama, qwen3

# By `config.model_type`. Mistral and Qwen2 name their modules as Llama does (Qwen2's q/k/v biases
# are sharded with their colwise weights); Qwen3 adds per-head q/k norms.
TP_PLANS = {"llama": llama, "mistral": llama, "qwen2": llama, "qwen3": qwen3}


def parallelize(model: nn.Module, parallel: Parallel, settings: ParallelConfig, precision: str) -> nn.Module:
    """Shard a meta-device HF causal LM over the 2-D mesh, in place. Returns the same model."""
    model_type = model.config.model_type
    if model_type not in TP_PLANS:
        raise ValueError(f"model type {model_type!r} has no TP plan; supported: {', '.join(TP_PLANS)}")
    plans = TP_PLANS[model_type]
    tied = model.config.tie_word_embeddings

    parallelize_module(
        model, parallel.tp_mesh, plans.model_plan(settings.sequence_parallel, settings.loss_parallel)
    )
    for layer in model.model.layers:
        parallelize_module(layer, parallel.tp_mesh, plans.layer_plan(settings.sequence_parallel))
    check_tp_coverage(model)
    if tied:  # parallelize_module replaced both Parameters; both are Shard(0) over the vocabulary
        model.lm_head.weight = model.model.embed_tokens.weight

    if settings.activation_checkpointing == "full":
        for index, layer in enumerate(model.model.layers):
            model.model.layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)

    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else torch.float32, reduce_dtype=torch.float32
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=parallel.dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=parallel.dp_mesh, mp_policy=mp_policy)
    # The loss is already divided by the global token count: FSDP must sum, not average, over dp.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    check_on_mesh(model, parallel)
    return model


def check_tp_coverage(model: nn.Module) -> None:
    """Every parameter must be sharded or replicated by the plan: a forgotten module would stay a
    plain tensor, off the mesh, and silently train as a different model on each tp rank."""
    missing = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if missing:
        raise RuntimeError(f"the TP plan covers no style for these parameters: {', '.join(missing)}")


def check_on_mesh(model: nn.Module, parallel: Parallel) -> None:
    """Fail loudly if any parameter is off the training mesh."""
    expected = tuple(parallel.mesh.mesh_dim_names)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise RuntimeError(f"parameter {name} is not a DTensor after parallelize")
        names = tuple(param.device_mesh.mesh_dim_names or ())
        if names != expected:
            raise RuntimeError(f"parameter {name} is on mesh {names}, expected {expected}")
