"""The training run: mesh → model → optimizer → data → loop. One page, top to bottom."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.checkpoint import Checkpointer, Progress, checkpoint_dir, load
from dtrain.config import Config, MeshShape
from dtrain.data import build_data, load_tokenizer
from dtrain.distributed import Parallel, build_parallel
from dtrain.export import export_hf
from dtrain.loss import IGNORE
from dtrain.metrics import count_parameters, flops_per_token, memory_figures, peak_flops
from dtrain.model import build_model, has_weights, tokenizer_source
from dtrain.optim import build_optimizer, build_scheduler
from dtrain.parallel.vocab import padded_vocab_size, saved_vocab_rows
from dtrain.reliability import Preempted, StepGuard
from dtrain.sinks import open_sinks
from dtrain.step import evaluate, local_micro_batch, micro_step, optimizer_step

log = logging.getLogger("dtrain")


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

    vocab_rows = padded_vocab_size(model_config.vocab_size, shape.tp, saved_vocab_rows(resume_from))
    model = build_model(model_config, config, parallel, device, vocab_rows)
    model.train()
    params = list(model.parameters())
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.train.max_steps)

    tokenizer_folder = tokenizer_source(config.model)
    tokenizer = load_tokenizer(tokenizer_folder)
    data = build_data(config.data, config.train, tokenizer, parallel.dp_rank, parallel.dp_size)
    batches = data.train  # state_dict() / load_state_dict(): where the global stream stands

    progress = load(resume_from, model, optimizer, scheduler, batches) if resume_from else Progress()
    checkpointer = Checkpointer(config.checkpoint, checkpoint_dir(config.checkpoint, run_dir), resolved)

    num_params = count_parameters(model)
    flops = flops_per_token(model_config, num_params, config.data.max_len)
    peak = peak_flops(device)
    shard_sizes = gather_shard_sizes(model)  # a collective: every rank, before rank 0 logs
    sinks = open_sinks(config, resolved, run_dir, progress.step) if is_rank0 else []
    if is_rank0:
        log_summary(model, parallel, config, num_params, shard_sizes, data.num_examples, tokenizer_folder)

    history: list[dict[str, Any]] = []
    token_group = parallel.token_group
    interval_start, interval_tokens, last_logged = time.perf_counter(), 0, progress.step
    data_wait = 0.0  # host seconds spent waiting for batches in this log interval
    tokens_seen = torch.tensor(float(progress.tokens_seen), device=device)
    guard = StepGuard(config.train)
    try:
        for step in range(progress.step, config.train.max_steps):
            if guard.preempted:  # a rank got SIGTERM/SIGUSR1 before the last step: save, stop
                if not checkpointer.due(step, config.train.max_steps):  # else saved just now
                    progress = Progress(step, int(tokens_seen.item()))
                    checkpointer.save(model, optimizer, scheduler, batches, progress)
                checkpointer.wait()
                raise Preempted(step)
            wait_start = time.perf_counter()
            host_batches = guard.agreed(step, batches.next_step)
            micro_batches = [local_micro_batch(mb, parallel) for mb in host_batches]
            data_wait += time.perf_counter() - wait_start
            # The loss is a token mean over the whole global batch: count its targets on every dp and
            # cp rank (and its non-pad slots, for the padding fraction).
            counts = sum(
                torch.stack([(mb["labels"] != IGNORE).sum(), mb["num_tokens"].sum()]) for mb in micro_batches
            ).float()
            dist.all_reduce(counts, group=token_group)
            tokens, filled = counts[0], counts[1]
            loss_sum = torch.zeros((), device=device)
            for mb in micro_batches:
                loss_sum += micro_step(
                    model,
                    mb,
                    tokens,
                    config.parallel.loss_parallel,
                    config.parallel.loss_impl,
                    config.parallel.loss_chunk,
                )
            guard.poison(step + 1, model)
            lr = scheduler.get_last_lr()[0]
            grad_norm, skipped = optimizer_step(
                optimizer,
                params,
                config.optim.max_grad_norm,
                functools.partial(guard.should_skip, step + 1, model=model),
            )
            if not skipped:  # never an optimizer step on non-finite gradients
                scheduler.step()
                tokens_seen += tokens

            interval_tokens += config.train.global_batch_size * config.data.max_len
            done = step + 1
            if checkpointer.due(done, config.train.max_steps):
                progress = Progress(step=done, tokens_seen=int(tokens_seen.item()))
                checkpointer.save(model, optimizer, scheduler, batches, progress)
            if config.train.eval_every and done % config.train.eval_every == 0:
                eval_start = time.perf_counter()
                record = {
                    "step": done,
                    **evaluate(
                        model,
                        data.eval,
                        parallel,
                        config.parallel.loss_parallel,
                        config.parallel.loss_impl,
                        config.parallel.loss_chunk,
                    ),
                }
                history.append(record)
                for sink in sinks:
                    sink.write(record)
                interval_start += time.perf_counter() - eval_start  # eval time is not training time
            if done % config.train.log_every and done != config.train.max_steps:
                continue
            dist.all_reduce(loss_sum, group=token_group)
            elapsed = time.perf_counter() - interval_start
            steps_in_interval = done - last_logged
            waited = {"data_wait_s": data_wait / steps_in_interval}
            worst = max_over_ranks({**memory_figures(device), **waited}, device)
            supervised = int(tokens.item())
            world = dist.get_world_size()
            record = {
                "step": done,
                "loss": (loss_sum / tokens).item(),
                "grad_norm": grad_norm.item(),
                "lr": lr,
                "tokens": supervised,
                "padding_fraction": 1.0
                - filled.item() / (config.train.global_batch_size * config.data.max_len),
                "tokens_per_s": supervised * steps_in_interval / elapsed,
                "input_tokens_per_s": interval_tokens / elapsed,
                "input_tokens_per_s_per_device": interval_tokens / elapsed / world,
                "step_time_s": elapsed / steps_in_interval,
                **worst,
                "mfu": flops * interval_tokens / elapsed / (peak * world) if peak else None,
                "skipped_steps": guard.skipped,
            }
            history.append(record)
            for sink in sinks:
                sink.write(record)
            interval_start, interval_tokens, last_logged, data_wait = time.perf_counter(), 0, done, 0.0

        checkpointer.wait()
        if config.checkpoint.export_hf:
            export_hf(model, tokenizer, run_dir / "hf", config.checkpoint.export_dtype)
    finally:  # also when the run fails: a sweep goes on in this process with the next job
        guard.close()
        for sink in sinks:
            sink.close()
    return RunResult(history, model, optimizer)


def max_over_ranks(figures: dict[str, float | None], device: torch.device) -> dict[str, float | None]:
    """The worst rank's value of each figure, in one all_reduce; None (undefined here) stays None."""
    defined = [key for key, value in figures.items() if value is not None]
    values = torch.tensor([float(figures[key]) for key in defined], device=device, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {**figures, **dict(zip(defined, values.tolist(), strict=True))}


def gather_shard_sizes(model: torch.nn.Module) -> list[int]:
    """Each rank's local parameter elements (its shards), in rank order."""
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, local)
    return sizes


def log_summary(
    model: torch.nn.Module,
    parallel: Parallel,
    config: Config,
    num_params: int,
    shard_sizes: list[int],
    n: int,
    tokenizer_folder: str,
) -> None:
    train = config.train
    accumulation = train.global_batch_size // (train.micro_batch_size * parallel.dp_size)
    mesh = dict(zip(parallel.mesh.mesh_dim_names, parallel.mesh.shape, strict=True))
    init = "weights loaded" if config.model.init == "pretrained" else "seeded random init"
    if config.model.init == "random" and config.model.name_or_path:
        weights = has_weights(config.model.name_or_path)
        init = "model.init=random: seeded random init" if weights else "no weights: seeded random init"
    log.info(
        f"model {config.model.name_or_path or 'from model.config'} ({init}) | tokenizer {tokenizer_folder} | "
        f"{model.config.model_type}: {num_params / 1e6:.2f} M parameters, per-rank shards "
        f"{describe_sizes(shard_sizes)} | mesh {mesh} "
        f"on {parallel.device.type} | global batch {train.global_batch_size}, micro batch "
        f"{train.micro_batch_size}, {accumulation} accumulation steps | {n} examples, "
        f"max_len {config.data.max_len}"
    )


def describe_sizes(sizes: list[int]) -> str:
    """Millions of elements per rank: all of them up to 16 ranks, else the range."""
    millions = [f"{size / 1e6:.3f}" for size in sizes]
    if len(sizes) <= 16:
        return f"{' '.join(millions)} M"
    return f"{min(sizes) / 1e6:.3f}-{max(sizes) / 1e6:.3f} M over {len(sizes)} ranks"
