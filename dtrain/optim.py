"""AdamW over the DTensor parameters, the LR schedule, and the global gradient norm."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from dtrain.config import OptimConfig
from dtrain.parallel.experts import experts_modules


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What AdamW, the grad norm, clipping and the non-finite guard see (LoRA: the adapters only)."""
    return [p for p in model.parameters() if p.requires_grad]


def mesh_of(param: torch.Tensor) -> tuple[str, ...]:
    """The names of the mesh a parameter lives on: with expert parallel, expert parameters live on
    the experts mesh and every other one on the parameters' mesh (dtrain.distributed.Parallel)."""
    return tuple(param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by mesh, in first-seen order: foreach kernels, fused AdamW and DTensor's
    norm take one mesh at a time."""
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(mesh_of(tensor), []).append(tensor)
    return list(groups.values())


def build_optimizer(model: nn.Module, settings: OptimConfig) -> torch.optim.Optimizer:
    """Over the trainable parameters; no weight decay on norms and biases (1-D). A mixture-of-experts
    model's experts get groups of their own, at any ep (so a checkpoint's groups match at every ep):
    with ep > 1 they live on another mesh, and fused AdamW steps each group on its own, so no kernel
    mixes meshes."""
    trainable = trainable_parameters(model)
    on_experts = {id(p) for _, module in experts_modules(model) for p in module.parameters()}
    groups = []
    for expert in (False, True):
        params = [p for p in trainable if (id(p) in on_experts) == expert]
        if expert and not params:
            continue
        groups += [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    # fused: one pass over each parameter, gradient and moment, no parameter-sized temporaries (the
    # foreach peak in the step is a list larger: 37.4 vs 35.0 GiB per rank, Llama-3-8B at tp=4). The
    # DTensorSpec leak of fused AdamW on DTensors (pytorch#188174) is fixed in torch 2.13, our floor.
    return torch.optim.AdamW(
        groups, lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps, fused=True
    )


# transformers' schedules (transformers/optimization.py, get_scheduler), the same float operations in
# the same order, so every step's learning rate is bit for bit theirs (tests/test_optim.py compares
# them): importing transformers.optimization imports its trainer utilities and, through them, peft
# and bitsandbytes where installed, about a second at every process start of every rank.
def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return float(step) / float(max(1.0, warmup)) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))  # half a cycle


def build_scheduler(optimizer: torch.optim.Optimizer, settings: OptimConfig, max_steps: int) -> LRScheduler:
    """optim.schedule as transformers' get_scheduler builds it (a LambdaLR of a partial function)."""
    warmup = settings.warmup_steps
    factors = {
        "constant": _constant,  # no warm-up, as transformers' constant schedule
        "constant_with_warmup": functools.partial(_constant_with_warmup, warmup=warmup),
        "linear": functools.partial(_linear, warmup=warmup, total=max_steps),
        "cosine": functools.partial(_cosine, warmup=warmup, total=max_steps),
    }
    if settings.schedule not in factors:
        raise ValueError(f"optim.schedule={settings.schedule!r}: one of {sorted(factors)}")
    return LambdaLR(optimizer, factors[settings.schedule])


@torch.no_grad()
def global_grad_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The true global norm over every mesh axis, and over both meshes with expert parallel (the
    norm of each mesh's norm)."""
    norms = []
    for grads in by_mesh([p.grad for p in parameters if p.grad is not None]) or [[]]:
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):  # a partial norm over (dp, tp): reduce it to the full value
            total = total.full_tensor()
        norms.append(total)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))


@torch.no_grad()
def clip_grads(parameters: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients to max_norm when their global norm exceeds it; max_norm <= 0: never."""
    if max_norm > 0:
        for params in by_mesh(parameters):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=True)
