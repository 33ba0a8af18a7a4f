"""The planner against a real GPU: planned peak / torch.cuda.max_memory_allocated for one step of a
~1B Llama (Llama-3.2-1B's shape, random weights) on one GPU; exits 1 unless the plan is within
TOLERANCE (10 %) of the measured peak. Run by bench/gpu_all.sh.

    python bench/gpu_estimate_check.py                   # plan on the CPU, then run on cuda:0
    python bench/gpu_estimate_check.py --plan-only       # the planning half only (any machine)
    python bench/gpu_estimate_check.py --dry-run         # both halves on the CPU, the embedded tiny model

Both halves run the trainer's own step (tests/test_estimate.py checks the same against gloo on
CPU): a warm-up step, then a measured step of the same micro-batches. The CUDA figure is the
allocator's peak of allocated bytes over the measured step (its blocks round up to 512 B, and it
sees cuBLAS/SDPA workspaces the tracker cannot); a ratio near 1 means the plan holds on GPUs.
`--dry-run` runs the same real step on the CPU (gloo, bf16) with the embedded tiny Llama: the CPU
has no allocator peak, so the plan is held to the tracker's peak of that real run instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtrain.checks import check_config  # noqa: E402
from dtrain.config import PlanConfig  # noqa: E402
from dtrain.distributed import build_parallel, init_distributed, shutdown  # noqa: E402
from dtrain.estimate.app import compose  # noqa: E402
from dtrain.estimate.measure import step_inputs, track_step, tracked_micro_batches  # noqa: E402
from dtrain.estimate.planner import plan  # noqa: E402
from dtrain.loss import LossSettings  # noqa: E402
from dtrain.model import build_model, load_model_config  # noqa: E402
from dtrain.objectives.sft import TokenLoss  # noqa: E402
from dtrain.optim import build_optimizer  # noqa: E402
from dtrain.step import optimizer_step  # noqa: E402

GIB = 2**30
TOLERANCE = 0.10  # issue 33: the planned peak within 10 % of the measured one


def overrides(args: argparse.Namespace) -> list[str]:
    model = ["model=tiny_llama"] if args.dry_run else ["model=llama3_2_1b"]
    layers = [] if args.dry_run else [f"+model.config.num_hidden_layers={args.layers}"]
    return [
        *model,
        "model.init=random",  # no weights to download; values do not change memory
        *layers,
        "parallel.tp=1",
        f"parallel.activation_checkpointing={args.checkpointing}",
        f"data.max_len={args.max_len}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"train.global_batch_size={2 * args.micro_batch_size}",  # two micro-batches: accumulation
        "train.precision=bf16",
        "estimate.world_size=1",
    ]


def real_step_peak(config: PlanConfig) -> tuple[int | None, int]:
    """(CUDA peak allocated, tracker peak) of one step on cuda:0 after a warm-up step; on the CPU
    (no CUDA device: the dry run) there is no allocator peak, and the first is None."""
    device = init_distributed(config.parallel.timeout_s)
    try:
        model_config = load_model_config(config.model, offline=True)
        shape = check_config(config, 1, model_config, files=False)
        parallel = build_parallel(shape, device)
        model = build_model(model_config, config, parallel, device)
        model.train()
        optimizer = build_optimizer(model, config.optim)
        params = list(model.parameters())
        train, max_norm = config.train, config.optim.max_grad_norm
        accumulation = train.global_batch_size // train.micro_batch_size
        micro_batches = step_inputs(train.micro_batch_size, config.data.max_len, accumulation, device)
        objective = TokenLoss(
            model, parallel, LossSettings.of(config.parallel), config.moe
        )  # the planner's loss
        tracked = micro_batches[: tracked_micro_batches(accumulation)]

        def step() -> None:
            objective.begin_step(tracked)
            for micro_batch in tracked:
                objective.micro_step(micro_batch)
            optimizer_step(optimizer, params, max_norm)

        step()  # warm-up: AdamW's states, cuBLAS handles
        cuda_peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated()
        memory = track_step(model, optimizer, micro_batches, objective, max_norm, len(tracked))
        return cuda_peak, memory.peak
    finally:
        shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-only", action="store_true", help="skip the real run")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the embedded tiny model, tiny batch")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (Llama-3.2-1B: 16)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--checkpointing", choices=("none", "full"), default="full")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.max_len, args.micro_batch_size = 64, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = compose(overrides(args))
    planned = plan(config, world_size=1)
    shape = "the embedded tiny Llama" if args.dry_run else f"Llama-3.2-1B shape, {args.layers} layers"
    print(
        f"{shape}, {planned.num_params / 1e9:.4f} B parameters, micro batch "
        f"{args.micro_batch_size} × {args.max_len}, bf16, checkpointing {args.checkpointing}: "
        f"planned peak {planned.step.peak / GIB:.4f} GiB ({planned.step.peak_phase}; {planned.seconds:.0f} s)"
    )
    figures = dict(shape=shape, planned_peak=planned.step.peak, peak_phase=planned.step.peak_phase)
    if args.plan_only:
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --plan-only or --dry-run, or on a GPU machine")
    cuda_peak, tracker_peak = real_step_peak(config)
    # The measured peak the plan answers to: the allocator's on CUDA; on the CPU the tracker's.
    measured, source = (cuda_peak, "cuda max_memory_allocated") if cuda_peak else (tracker_peak, "tracker")
    ratio = planned.step.peak / measured
    cuda = f"{cuda_peak / GIB:.4f} GiB" if cuda_peak else "none (CPU)"
    print(f"cuda max_memory_allocated {cuda} | tracker on the real run {tracker_peak / GIB:.4f} GiB")
    print(f"ratio planned / {source}: {ratio:.3f} (tolerance {TOLERANCE:.0%})")
    figures.update(cuda_peak=cuda_peak, tracker_peak=tracker_peak, measured_by=source, ratio=ratio)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if abs(ratio - 1) > TOLERANCE:
        sys.exit(
            f"gpu_estimate_check: planned peak is {ratio:.3f}× the {source} peak, outside {TOLERANCE:.0%}"
        )


if __name__ == "__main__":
    main()
