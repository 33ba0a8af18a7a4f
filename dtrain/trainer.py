"""The training run: `start_run` builds it (mesh → model → optimizer → data → checkpoint → sinks),
`train` is the loop. One page, top to bottom; the step itself is dtrain/step.py."""

from __future__ import annotations

import functools
import gc
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedTokenizerBase

from dtrain import collector
from dtrain.checkpoint import Checkpointer, Progress, checkpoint_dir, load, load_objective
from dtrain.config import Config, MeshShape, TrainConfig
from dtrain.data.formats import load_tokenizer
from dtrain.data.pipeline import SFTData, build_data
from dtrain.distributed import Parallel, build_parallel
from dtrain.export import export_hf, export_merged
from dtrain.faults import Faults
from dtrain.metrics import StepMeter, count_parameters, flops_per_token, peak_flops
from dtrain.model import build_frozen_model, build_model, has_weights, tokenizer_source
from dtrain.objectives import Context, Objective, build_objective, objective_of
from dtrain.optim import build_optimizer, build_scheduler, trainable_parameters
from dtrain.parallel import lora
from dtrain.parallel.experts import idle_parameters
from dtrain.parallel.vocab import padded_vocab_size, saved_vocab_rows
from dtrain.reliability import Preempted, StallWatch, StepGuard
from dtrain.sinks import Sink, open_sinks
from dtrain.step import optimizer_step

log = logging.getLogger("dtrain")
# Python's cyclic collector runs at known points of a run (dtrain/collector.py): once the run is
# built, then every GC_EVERY_STEPS steps, torchtitan's default (its training.gc_freq). Generation 1
# is everything made since the last collection: nothing is promoted while automatic collection is off.
GC_EVERY_STEPS = 50


@dataclass
class RunResult:
    history: list[dict[str, Any]]  # the logged records, on every rank
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    parallel: Parallel  # the mesh the model lives on


@dataclass
class Run:
    """Everything one training run holds, built by start_run."""

    parallel: Parallel
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    tokenizer: PreTrainedTokenizerBase
    data: SFTData  # data.train: where the global stream stands (state_dict / load_state_dict)
    progress: Progress  # where the run starts: 0, or the checkpoint's step
    checkpointer: Checkpointer
    guard: StepGuard
    faults: Faults | None  # the tests' fault injection; None in a normal run
    meter: StepMeter
    sinks: list[Sink]  # rank 0's; none on the other ranks
    objective: Objective  # what a step optimizes: SFT's token loss, DPO's pair loss
    history: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        for sink in self.sinks:
            sink.write(record)

    def save(self, step: int, tokens_seen: torch.Tensor) -> None:
        progress = Progress(step, int(tokens_seen.item()))
        state = self.objective.state_dict()
        self.checkpointer.save(self.model, self.optimizer, self.scheduler, self.data.train, progress, state)

    def close(self) -> None:
        self.guard.close()
        for sink in self.sinks:
            sink.close()


def start_run(
    config: Config,
    shape: MeshShape,
    model_config: Any,
    device: torch.device,
    run_dir: Path,
    resolved: dict[str, Any],
    resume_from: Path | None = None,
) -> Run:
    """Build the run (from `resume_from`, a checkpoint folder, if given) and say what it is."""
    parallel = build_parallel(shape, device)
    torch.manual_seed(config.train.seed)
    vocab_rows = padded_vocab_size(model_config.vocab_size, shape.tp, saved_vocab_rows(resume_from))
    model = build_model(model_config, config, parallel, device, vocab_rows)
    model.train()
    optimizer = build_optimizer(model, config.optim)
    tokenizer_folder = tokenizer_source(config.model)
    tokenizer = load_tokenizer(tokenizer_folder)
    stream, dp_rank, dp_size = objective_of(config).stream(config, parallel.dp_rank, parallel.dp_size)
    data = build_data(config.data, stream, tokenizer, dp_rank, dp_size)
    if config.train.epochs is not None:  # the rows are packed now: the run's length is known
        config.train.max_steps = steps_for_epochs(config.train, len(data.train))
    scheduler = build_scheduler(optimizer, config.optim, config.train.max_steps)
    progress = load(resume_from, model, optimizer, scheduler, data.train) if resume_from else Progress()
    # the config's objective: SFT's token loss, DPO's pair loss with its reference (precomputed now) ...
    frozen = functools.partial(
        build_frozen_model, config, parallel, device, policy=model_config, vocab_rows=vocab_rows
    )
    context = Context(config, model, parallel, frozen, data, run_dir, progress.step, resume_from)
    objective = build_objective(context)
    if resume_from:  # its own state (DPO's TR-DPO reference), once it is built
        load_objective(resume_from, objective)
    faults = Faults.from_env()
    checkpointer = Checkpointer(
        config.checkpoint, checkpoint_dir(config.checkpoint, run_dir), resolved, faults
    )

    num_params = count_parameters(model)
    trainable = sum(p.numel() for p in trainable_parameters(model))  # LoRA: no base weight gradients
    active = num_params - idle_parameters(model)  # a mixture of experts: the top-k experts' share
    flops = flops_per_token(model_config, active, config.data.max_len, min(trainable, active))
    meter = StepMeter(config.train, flops, peak_flops(device), device, progress.step)
    shard_sizes = gather_shard_sizes(model)  # a collective: every rank, before rank 0 logs
    sinks = []
    if dist.get_rank() == 0:
        sinks = open_sinks(config, resolved, run_dir, progress.step)
        log_summary(
            model, parallel, config, num_params, trainable, shard_sizes, data.examples(), tokenizer_folder,
            objective.describe(),
        )  # fmt: skip
    guard = StepGuard(config.train, faults, save_due=checkpointer.due_by_time)
    return Run(
        parallel=parallel,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        tokenizer=tokenizer,
        data=data,
        progress=progress,
        checkpointer=checkpointer,
        guard=guard,
        faults=faults,
        meter=meter,
        sinks=sinks,
        objective=objective,
    )


@collector.paused()  # collected after building and every GC_EVERY_STEPS steps instead
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
    run = start_run(config, shape, model_config, device, run_dir, resolved, resume_from)
    gc.collect(1)  # what building the run left in reference cycles, before its first step
    model, parallel, meter, guard = run.model, run.parallel, run.meter, run.guard
    settings = config.train
    params = trainable_parameters(model)
    objective = run.objective
    tokens_seen = torch.tensor(float(run.progress.tokens_seen), device=device)
    saved = run.progress.step  # the step of the newest checkpoint
    stall = StallWatch(model_config.vocab_size)
    try:
        for step in range(run.progress.step, settings.max_steps):
            if guard.preempted:  # a rank got SIGTERM/SIGUSR1/SIGINT before the last step: save, stop
                if saved != step:
                    run.save(step, tokens_seen)
                run.checkpointer.wait()
                raise Preempted(step)
            read = functools.partial(guard.agreed, step, run.data.train.next_step)
            with meter.waiting_for_data():
                micro_batches = objective.next_batches(step, read)
            objective.begin_step(micro_batches)  # the global counts the loss is a mean over
            for mb in micro_batches:
                objective.micro_step(mb)
            if run.faults:
                run.faults.poison(step + 1, model)
            lr = run.scheduler.get_last_lr()[0]
            should_skip = functools.partial(guard.should_skip, step + 1, model=model)
            max_norm = config.optim.max_grad_norm
            grad_norm, skipped = optimizer_step(run.optimizer, params, max_norm, should_skip)
            if not skipped:  # never an optimizer step on non-finite gradients
                run.scheduler.step()
                tokens_seen += objective.tokens

            done = step + 1
            objective.end_step(done)
            if done % GC_EVERY_STEPS == 0:
                gc.collect(1)
            if run.checkpointer.due(done, settings.max_steps) or guard.save_now:
                run.save(done, tokens_seen)
                saved = done
            if settings.eval_every and done % settings.eval_every == 0:
                with meter.paused():  # eval time is not training time
                    run.emit({"step": done, **objective.evaluate(run.data.eval)})
            if meter.due(done):
                figures = objective.figures()  # reduced over the ranks
                counts = figures.supervised, figures.filled, figures.slots
                logged = figures.loss, grad_norm.item(), lr, figures.tokens, counts
                run.emit({**meter.record(done, *logged, guard.skipped), **figures.extra})
                stall.check(done, figures.loss, logged[1])

        run.checkpointer.wait()
        if config.checkpoint.export_hf:
            export_hf(model, run.tokenizer, run_dir / "hf", config.checkpoint.export_dtype)
        if config.checkpoint.export_merged:  # LoRA: the base with the adapters merged in
            export_merged(model, run.tokenizer, run_dir / "hf-merged", config.checkpoint.export_dtype)
    finally:  # also when the run fails: a sweep goes on in this process with the next job
        run.close()
    return RunResult(run.history, model, run.optimizer, parallel)


def steps_for_epochs(settings: TrainConfig, rows: int) -> int:
    """train.epochs as optimizer steps: every row once per epoch, the last step completed."""
    steps = max(1, math.ceil(settings.epochs * rows / settings.global_batch_size))
    log.info(
        f"train.epochs={settings.epochs}: {steps} steps ({rows} rows per epoch, "
        f"global batch {settings.global_batch_size})"
    )
    return steps


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
    trainable: int,
    shard_sizes: list[int],
    examples: str,
    tokenizer_folder: str,
    objective: str = "",
) -> None:
    train = config.train
    accumulation = train.global_batch_size // (train.micro_batch_size * parallel.dp_size)
    mesh = dict(zip(parallel.mesh.mesh_dim_names, parallel.mesh.shape, strict=True))
    if parallel.ep_size > 1:  # the experts' split of the fsdp ranks
        mesh |= {"efsdp": parallel["efsdp"].shape[-1], "ep": parallel.ep_size}
    init = "weights loaded" if config.model.init == "pretrained" else "seeded random init"
    if config.model.init == "random" and config.model.name_or_path:
        weights = has_weights(config.model.name_or_path)
        init = "model.init=random: seeded random init" if weights else "no weights: seeded random init"
    log.info(
        f"model {config.model.name_or_path or 'from model.config'} ({init}) | tokenizer {tokenizer_folder} | "
        f"{model.config.model_type}: {num_params / 1e6:.2f} M parameters, {trainable / 1e6:.3f} M trainable "
        f"({100 * trainable / num_params:.2f} %){adapters_note(model, config)}, per-rank shards "
        f"{describe_sizes(shard_sizes)} | mesh {mesh} "
        f"on {parallel.device.type} | global batch {train.global_batch_size}, micro batch "
        f"{train.micro_batch_size}, {accumulation} accumulation steps | {examples}, "
        f"max_len {config.data.max_len} | loss {config.parallel.loss_impl}"
        + (f" | {objective}" if objective else "")
    )


def adapters_note(model: torch.nn.Module, config: Config) -> str:
    """What a LoRA run trains on (for the start line): the adapters' rank and scale and the frozen
    base's dtype, NF4 for QLoRA (the weights NF4 leaves dense keep train.precision's)."""
    settings = getattr(model, lora.SETTINGS_ATTR, None)
    if settings is None:
        return ""
    scale = f"alpha {settings.alpha:g}{', rsLoRA' if settings.use_rslora else ''}"
    names = {dtype: name for name, dtype in lora.DTYPES.items()}
    dense = names[lora.base_dtype(config.lora, config.train.precision)]
    base = f"an NF4 base (QLoRA; the rest {dense})" if config.lora.base_dtype == "nf4" else f"a {dense} base"
    return f": LoRA r={settings.r}, {scale}, on {base}"


def describe_sizes(sizes: list[int]) -> str:
    """Millions of elements per rank: all of them up to 16 ranks, else the range."""
    millions = [f"{size / 1e6:.3f}" for size in sizes]
    if len(sizes) <= 16:
        return f"{' '.join(millions)} M"
    return f"{min(sizes) / 1e6:.3f}-{max(sizes) / 1e6:.3f} M over {len(sizes)} ranks"
