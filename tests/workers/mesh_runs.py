"""Launched by the tests by run_worker: every scenario for this world size on one process group.

For each scenario rank 0 saves `<out>/<name>.pt` with the logged history and the final full
parameters; every rank asserts the sharding invariants (a failure exits non-zero). The pytest side
compares the files with a single-process Hugging Face reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from dtrain.checks import check_config
from dtrain.distributed import Parallel, init_distributed
from dtrain.model import canonical_name, load_model_config
from dtrain.parallel import fused
from dtrain.step import local_micro_batch, summed_loss
from dtrain.trainer import train
from tests.helpers import (
    FAMILIES,
    GLOBAL_BATCH,
    check_sharding,
    cross_rank_row,
    full,
    full_logits,
    one_backward,
    packed_documents,
    parity_config,
    sharded_model,
    worker_args,
)

EXPORT = {"checkpoint.export_hf": True, "checkpoint.export_dtype": "fp32"}
PACKED = {"data.packing": True}
# Micro-batches of half the global batch: at dp = 2 each rank's rows at once (one micro-batch a
# step), at dp = 1 (all of tp, all of cp) 2 micro-batches a step, not 4 of 4: accumulation at half
# the DTensor calls (the micro-batches' count is the trainer's, the same on every mesh)
HALF_BATCH = {"train.micro_batch_size": GLOBAL_BATCH // 2}
# the seeded init's runs compare the two meshes' init and first losses: 3 steps say it
SEEDED_INIT = {"train.max_steps": 3}
# name: (dp, tp, model, overrides); model is "untied", "tied", "random" (seeded init) or a family
# of helpers.FAMILIES
SCENARIOS = {
    1: {
        "1x1": (1, 1, "untied", {}),
        "1x1_tied": (1, 1, "tied", {}),
        "1x1_random": (1, 1, "random", SEEDED_INIT),
    },
    4: {
        "2x2": (2, 2, "untied", {}),
        "2x2_tied": (2, 2, "tied", {}),
        "2x2_no_sp": (2, 2, "untied", {"parallel.sequence_parallel": False}),
        "2x2_bf16": (2, 2, "untied", {"train.precision": "bf16"}),
        "1x4": (1, 4, "untied", HALF_BATCH),
        "4x1": (4, 1, "untied", {}),
        "2x2_random": (2, 2, "random", SEEDED_INIT),
        # every family trained, then exported at the end of training (fp32, to compare logits); in
        # one micro-batch per step (accumulation is the trainer's, the same for every family: the
        # Llama meshes above check it)
        **{f"2x2_{family}": (2, 2, family, {**EXPORT, **HALF_BATCH}) for family in FAMILIES},
        # context parallel on packed rows whose documents cross the chunk borders
        "cp4": (1, 1, "untied", {"parallel.cp": 4, **PACKED, **HALF_BATCH}),
        "cp2_tp2": (1, 2, "untied", {"parallel.cp": 2, **PACKED, **HALF_BATCH}),
        "cp2_dp2": (2, 1, "untied", {"parallel.cp": 2, **PACKED}),
    },
}


# families whose packed rows are also run at tp=2: documents longer than the sliding window
PACKED_WINDOW = ("gemma3_text",)


@torch.no_grad()
def packed_logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of helpers.packed_documents() packed into one row (restarting positions), gathered."""
    ids, positions = packed_documents()
    logits = model(input_ids=ids, position_ids=positions).logits
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


# families whose q/k norms span the whole width: layer 0's q_norm output is saved at tp=2
WIDTH_NORMS = ("olmo2",)


@torch.no_grad()
def q_norm_output(model: torch.nn.Module) -> torch.Tensor:
    """Layer 0's q_norm output on helpers.fixed_batch(), this rank's columns gathered over tp."""
    norm = model.model.layers[0].self_attn.q_norm
    captured = []
    handle = norm.register_forward_hook(lambda module, args, output: captured.append(output))
    full_logits(model)
    handle.remove()
    tp_mesh = norm.weight.device_mesh["tp"]
    return DTensor.from_local(captured[0], tp_mesh, [Shard(-1)], run_check=False).full_tensor()


def apply_overrides(config: object, overrides: dict) -> None:
    for key, value in overrides.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)


@torch.no_grad()
def cp_rank_losses(model: torch.nn.Module, parallel: Parallel) -> list[float]:
    """Each cp rank's own summed token loss on helpers.cross_rank_row(), as is and with one token
    changed that only the last cp rank holds: [loss, loss with the token changed] of rank 0."""
    losses = []
    for batch in cross_rank_row():
        losses.append(summed_loss(model, local_micro_batch(batch, parallel)).item())
    return losses


def main() -> None:
    args = worker_args()
    device = init_distributed(timeout_s=300)
    world = dist.get_world_size()
    for name, (dp, tp, kind, overrides) in SCENARIOS[world].items():
        models = {"untied": args.untied, "tied": args.tied, "random": None}
        model_dir = models[kind] if kind in models else args.families / kind
        config = parity_config(model_dir, dp, tp)
        apply_overrides(config, overrides)
        model_config = load_model_config(config.model)
        shape = check_config(config, world, model_config)
        run_dir = args.out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        result = train(config, shape, model_config, device, run_dir, resolved={})
        one_backward(result.model)
        check_sharding(result.model, result.optimizer, dp, tp, config.parallel.cp)
        params = {canonical_name(n): full(p) for n, p in result.model.named_parameters()}
        params = fused.fuse(result.model, params)  # HF's names and layout, as the reference has
        saved = {"history": result.history, "params": params}
        # the freshly loaded model (or seeded init) only where a test reads it: the suite's time
        fresh = sharded_model(config, device) if kind in (*models, *WIDTH_NORMS) else None
        if kind == "random":
            saved["init"] = {n: full(p) for n, p in fresh.named_parameters()}
        elif kind in models:
            saved["logits"] = full_logits(fresh)
        if overrides.get("checkpoint.export_hf"):
            saved["trained_logits"], saved["hf"] = full_logits(result.model), str(run_dir / "hf")
        if kind in WIDTH_NORMS:
            saved["q_norm"] = q_norm_output(fresh)
        if config.parallel.cp == 4:
            saved["cp_rank_losses"] = cp_rank_losses(result.model, result.parallel)
        if kind in PACKED_WINDOW:
            config.data.packing = True
            saved["packed_logits"] = packed_logits(sharded_model(config, device))
        if dist.get_rank() == 0:
            torch.save(saved, args.out / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
