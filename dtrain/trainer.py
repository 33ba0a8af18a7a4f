"""The training run: mesh → model → optimizer → data → loop. One page, top to bottom."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.checkpoint import Checkpointer, Progress, checkpoint_dir, load
from dtrain.config import Config, MeshShape
from dtrain.data import IGNORE, StepBatches, load_examples, load_tokenizer
from dtrain.distributed import Parallel, build_parallel
from dtrain.export import export_hf
from dtrain.loss import loss_context, summed_cross_entropy
from dtrain.metrics import count_parameters, flops_per_token, log, open_sinks, peak_flops, peak_memory_gib
from dtrain.model import build_meta_model, materialize, resolve_model_path
from dtrain.optim import build_optimizer, build_scheduler, clip_grad_norm
from dtrain.parallel.parallelize import parallelize


@dataclass
class RunResult:
    history: list[dict[str, Any]]  # the logged records, on every rank
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def train(
    config: Config,
    shape: MeshShape,
    model_config: Any,
    device: torch.device,
    run_dir: Path,
    resolved: dict[str, Any],
    resume_from: Path | None = None,
) -> RunResult:
    """Train (from `resume_from`, a checkpoint folder, if given); rank 0 also writes the logged
    records to the sinks."""
    is_rank0 = dist.get_rank() == 0
    parallel = build_parallel(shape, device)
    torch.manual_seed(config.train.seed)

    model = build_meta_model(model_config)
    parallelize(model, parallel, config.parallel, config.train.precision)
    materialize(model, device, config.model, config.train.seed)
    model.train()
    params = list(model.parameters())
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.train.max_steps)

    tokenizer = load_tokenizer(config.model.tokenizer or resolve_model_path(config.model.name_or_path))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = StepBatches(
        load_examples(config.data, tokenizer),
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=config.train.micro_batch_size,
        dp_rank=parallel.dp_rank,
        dp_size=parallel.dp_size,
        max_len=config.data.max_len,
        pad_id=pad_id,
        seed=config.train.seed,
        shuffle=config.data.shuffle,
    )

    progress = load(resume_from, model, optimizer, scheduler, batches) if resume_from else Progress()
    checkpointer = Checkpointer(config.checkpoint, checkpoint_dir(config.checkpoint, run_dir), resolved)

    num_params = count_parameters(model)
    flops = flops_per_token(model_config, num_params, config.data.max_len)
    peak = peak_flops(device)
    sinks = open_sinks(config, resolved, run_dir) if is_rank0 else []
    if is_rank0:
        log_summary(model, parallel, config, num_params, len(batches.examples))

    history: list[dict[str, Any]] = []
    dp_group = parallel.dp_mesh.get_group()
    interval_start, interval_tokens, last_logged = time.perf_counter(), 0, progress.step
    tokens_seen = torch.tensor(float(progress.tokens_seen), device=device)
    for step in range(progress.step, config.train.max_steps):
        micro_batches = [
            {k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in batches.micro_batches(step)
        ]
        # The loss is a token mean over the whole global batch: count its targets on every dp rank.
        tokens = sum((mb["labels"] != IGNORE).sum() for mb in micro_batches).float()
        dist.all_reduce(tokens, group=dp_group)
        loss_sum = torch.zeros((), device=device)
        for mb in micro_batches:
            loss_sum += micro_step(model, mb, tokens, config.parallel.loss_parallel)
        lr = scheduler.get_last_lr()[0]
        grad_norm = optimizer_step(optimizer, params, config.optim.max_grad_norm)
        scheduler.step()
        tokens_seen += tokens

        interval_tokens += config.train.global_batch_size * config.data.max_len
        done = step + 1
        if checkpointer.due(done, config.train.max_steps):
            progress = Progress(step=done, tokens_seen=int(tokens_seen.item()))
            checkpointer.save(model, optimizer, scheduler, batches, progress)
        if done % config.train.log_every and done != config.train.max_steps:
            continue
        dist.all_reduce(loss_sum, group=dp_group)
        memory = torch.tensor(peak_memory_gib(device), device=device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        elapsed = time.perf_counter() - interval_start
        steps_in_interval = done - last_logged
        supervised = int(tokens.item())
        record = {
            "step": done,
            "loss": (loss_sum / tokens).item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens": supervised,
            "tokens_per_s": supervised * steps_in_interval / elapsed,
            "input_tokens_per_s": interval_tokens / elapsed,
            "step_time_s": elapsed / steps_in_interval,
            "mem_peak_gib": memory.item(),
            "mfu": flops * interval_tokens / elapsed / (peak * dist.get_world_size()) if peak else None,
        }
        history.append(record)
        for sink in sinks:
            sink.write(record)
        interval_start, interval_tokens, last_logged = time.perf_counter(), 0, done

    checkpointer.wait()
    if config.checkpoint.export_hf:
        export_hf(model, tokenizer, run_dir / "hf", config.checkpoint.export_dtype)
    for sink in sinks:
        sink.close()
    return RunResult(history, model, optimizer)


def micro_step(
    model: torch.nn.Module, micro_batch: dict[str, torch.Tensor], tokens: torch.Tensor, loss_parallel: bool
) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; returns its summed loss, detached. A function of
    its own so the logits die with it, and so dtrain.estimate measures exactly this step."""
    with loss_context(loss_parallel):
        logits = model(
            input_ids=micro_batch["input_ids"], position_ids=micro_batch["position_ids"], use_cache=False
        ).logits
        loss = summed_cross_entropy(logits, micro_batch["labels"])
        (loss / tokens).backward()
    return loss.detach()


def optimizer_step(optimizer: torch.optim.Optimizer, params: list, max_grad_norm: float) -> torch.Tensor:
    """Clip, step, drop the gradients. Returns the norm before clipping."""
    grad_norm = clip_grad_norm(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def log_summary(model: torch.nn.Module, parallel: Parallel, config: Config, num_params: int, n: int) -> None:
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    train = config.train
    accumulation = train.global_batch_size // (train.micro_batch_size * parallel.dp_size)
    mesh = dict(zip(parallel.mesh.mesh_dim_names, parallel.mesh.shape, strict=True))
    log.info(
        f"model {model.config.model_type}: {num_params / 1e6:.2f} M parameters, "
        f"{local / 1e6:.3f} M on rank 0 | mesh {mesh} "
        f"on {parallel.device.type} | global batch {train.global_batch_size}, micro batch "
        f"{train.micro_batch_size}, {accumulation} accumulation steps | {n} examples, "
        f"max_len {config.data.max_len}"
    )
