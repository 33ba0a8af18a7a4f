"""Launched by tests/test_hsdp.py by run_worker on 8 processes, every scenario on one process group:

- `hsdp`: HSDP 2×2×2 (dp_replicate, dp_shard, tp) trains the parity run, checkpointing at steps 4
  and 8; its sharding invariants are asserted on every rank.
- `resume_fsdp`: step 4 of `hsdp` resumed on plain FSDP 4×2 (dp_shard, tp); it checkpoints at step 8.
- `resume_hsdp`: step 8 of `resume_fsdp` resumed on HSDP 2×4×1: back from FSDP to HSDP.
- `cp`: dp 2 × cp 2 × tp 2 on packed rows (documents cross the chunk borders), checkpointing at steps
  4 and 8; its sharding (over dp_shard × cp and tp) is asserted on every rank.
- `resume_cp4` and `resume_cp1`: step 8 of `cp` resumed at cp = 4 (dp 2 × cp 4) and at cp = 1
  (dp 4 × tp 2): the model state does not depend on cp.
- `unplanned`: a Linear the TP plan does not name, added to a decoder layer: parallelize must refuse it.
- `moe`: the tiny Qwen3-MoE (aux loss on) at dp_shard 4 × tp 2 with ep 2: experts split over ep,
  FSDP-sharded over efsdp 2 (dp_shard 4 = efsdp 2 × ep 2), replicated over tp; the rest as a dense
  model. tests/workers/moe_runs.py's config (moe_config), 10 steps; both meshes' sharding asserted.

Rank 0 saves `<out>/<name>.pt`; a failed invariant exits non-zero.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from dtrain.checks import check_config
from dtrain.distributed import build_parallel, init_distributed
from dtrain.model import build_meta_model, canonical_name, load_model_config
from dtrain.parallel.parallelize import parallelize
from dtrain.trainer import train
from tests.helpers import check_expert_sharding, check_sharding, one_backward, parity_config, save_results
from tests.workers.moe_runs import DenseView, moe_config

UNPLANNED = "extra_proj"  # tests/test_hsdp.py looks for this name in the error
# the mixture-of-experts run: dp_shard (efsdp × ep), tp, ep
MOE_MESH = (4, 2, 2)


def hsdp_config(model_dir: Path, replicate: int, shard: int, tp: int, out: Path, name: str):
    config = parity_config(model_dir, shard, tp)
    config.parallel.dp_replicate = replicate
    train = config.train  # dp = 8 (2 × 4) takes micro-batches of 2 rows: 16 rows a step
    train.micro_batch_size = min(train.micro_batch_size, train.global_batch_size // (replicate * shard))
    config.checkpoint.every = 4
    config.checkpoint.dir = str(out / name / "checkpoints")
    return config


def cp_config(model_dir: Path, shard: int, cp: int, tp: int, out: Path, name: str):
    config = hsdp_config(model_dir, 1, shard, tp, out, name)
    config.parallel.cp = cp
    config.data.packing = True
    return config


def run(config, name: str, out: Path, device: torch.device, resume_from: Path | None = None):
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    return train(config, shape, model_config, device, out / name, resolved, resume_from)


def unplanned_linear_error(model_dir: Path, device: torch.device) -> str | None:
    """parallelize on a model with one Linear no plan covers; returns the error, None if accepted."""
    config = parity_config(model_dir, 2, 2)
    config.parallel.dp_replicate = 2
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    model = build_meta_model(model_config)
    with torch.device("meta"):
        model.model.layers[1].mlp.add_module(UNPLANNED, nn.Linear(model_config.hidden_size, 8))
    try:
        parallelize(model, build_parallel(shape, device), config.parallel, config.train.precision)
    except RuntimeError as error:
        return str(error)
    return None


def moe_run(model_dir: Path, out: Path, device: torch.device) -> dict:
    """MOE_MESH through the trainer: the history and final full weights, both meshes' sharding
    asserted (the dense parameters as any dense model's, the experts over efsdp, ep and tp)."""
    dp, tp, ep = MOE_MESH
    # one micro-batch of 4 rows per dp rank, the whole global batch a micro-step (accumulation with
    # experts is test_moe's; 2 micro-batches here would cost 16 s more CPU over the 8 ranks), every
    # slot in the aux loss: HF's aux loss of the global batch without a mask, test_moe's global_batch
    # reference (the aux scopes and padding are test_moe's; this run is about the mesh)
    config = moe_config(model_dir, dp, tp, ep)
    config.train.micro_batch_size, config.moe.aux_mask_padding = 4, False
    result = run(config, "moe", out, device)
    one_backward(result.model)
    check_sharding(DenseView(result.model), result.optimizer, dp=dp, tp=tp)
    check_expert_sharding(result.model, result.optimizer, ep=ep, efsdp=dp // ep, tp=tp)
    params = {canonical_name(n): p.full_tensor() for n, p in result.model.named_parameters()}
    return {"history": result.history, "params": params}


def dense_runs(model_dir: Path, out: Path, device: torch.device) -> dict:
    """The Llama scenarios: hsdp and its resumes, cp and its resumes, unplanned."""
    results = {}
    hsdp = run(hsdp_config(model_dir, 2, 2, 2, out, "hsdp"), "hsdp", out, device)
    one_backward(hsdp.model)
    check_sharding(hsdp.model, hsdp.optimizer, dp=2, tp=2, replicate=2)
    params = {canonical_name(n): p.full_tensor() for n, p in hsdp.model.named_parameters()}
    results["hsdp"] = {"history": hsdp.history, "params": params}

    step4 = out / "hsdp" / "checkpoints" / "step-00000004"
    fsdp = run(hsdp_config(model_dir, 1, 4, 2, out, "resume_fsdp"), "resume_fsdp", out, device, step4)
    results["resume_fsdp"] = {"history": fsdp.history}

    step8 = out / "resume_fsdp" / "checkpoints" / "step-00000008"
    back = run(hsdp_config(model_dir, 2, 4, 1, out, "resume_hsdp"), "resume_hsdp", out, device, step8)
    one_backward(back.model)
    check_sharding(back.model, back.optimizer, dp=4, tp=1, replicate=2)
    results["resume_hsdp"] = {"history": back.history}

    cp = run(cp_config(model_dir, 2, 2, 2, out, "cp"), "cp", out, device)
    one_backward(cp.model)
    check_sharding(cp.model, cp.optimizer, dp=2, tp=2, cp=2)
    params = {canonical_name(n): p.full_tensor() for n, p in cp.model.named_parameters()}
    results["cp"] = {"history": cp.history, "params": params}
    # both from step 8: two steps on the new mesh say it (from step 4, cp 4 cost 4 more steps on 8 ranks)
    for name, (shard, degree, tp, step) in {"resume_cp4": (2, 4, 1, 8), "resume_cp1": (4, 1, 2, 8)}.items():
        checkpoint = out / "cp" / "checkpoints" / f"step-{step:08d}"
        resumed = run(cp_config(model_dir, shard, degree, tp, out, name), name, out, device, checkpoint)
        results[name] = {"history": resumed.history}

    results["unplanned"] = {"error": unplanned_linear_error(model_dir, device)}
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--untied", type=Path, required=True, help="helpers.save_tiny_llama's untied model")
    parser.add_argument("--moe", type=Path, required=True, help="helpers.save_tiny_moe's model")
    parser.add_argument("--only", default="", help="dense or moe (default: both)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out, device = args.out, init_distributed(timeout_s=300)
    assert dist.get_world_size() == 8, "hsdp_runs.py runs on 8 processes"
    results = {}
    if args.only in ("", "dense"):
        results |= dense_runs(args.untied, out, device)
    if args.only in ("", "moe"):
        results["moe"] = moe_run(args.moe, out, device)
    save_results(results, out)


if __name__ == "__main__":
    main()
