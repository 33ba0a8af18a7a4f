"""Launched by tests/test_dpo.py by run_worker (1 and 4 processes): every dtrain.dpo scenario of
that world size on one process group, through the real trainer. Rank 0 saves `<out>/<name>.pt`: the
logged history (and for LoRA the initial adapters, for the TRL reference; for the resumed run what
happened to the reference table). The pytest side compares them with TRL's DPOTrainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.checks import check_config
from dtrain.config import PreferenceConfig
from dtrain.distributed import init_distributed
from dtrain.model import load_model_config
from dtrain.parallel.lora import peft_tensors
from dtrain.trainer import train
from tests.helpers import parity_config, save_results, sharded_model

STEPS, GLOBAL_BATCH, MAX_LEN, LR = 3, 8, 32, 3e-3
# The run TRL must reproduce: fp32, AdamW (0.9, 0.95) without decay, clip 1.0, cosine from step 1,
# the pairs in file order; per dp rank micro-batches of half its pairs (accumulation 2) unless said.
BASE = {"data.format": "preference", "data.shuffle": False, "data.max_len": MAX_LEN}
BASE |= {"parallel.loss_impl": "auto", "optim.lr": LR, "optim.weight_decay": 0.0, "optim.warmup_steps": 0}
BASE |= {"train.max_steps": STEPS, "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": 4}
LORA = {"lora.r": 4, "lora.alpha": 8.0}
SIGMOID, IPO = {"dpo.loss_type": "sigmoid"}, {"dpo.loss_type": "ipo"}
MESHES = {  # 4 ranks
    "dp4": {"parallel.dp_shard": 4, "train.micro_batch_size": 1},
    "tp2_dp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 2},  # sequence parallel
    "cp2_tp2": {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1, "data.packing": True},
    "hsdp": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1},
    "lora_tp2_dp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 2, **LORA},
    # one micro-step a step: the default aux scope (moe.aux_scope=micro_step) is then HF's aux loss over
    # the whole batch, which TRL computes in its one forward of the batch
    "moe_ep2_tp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.ep": 2, "train.micro_batch_size": 4},
}
MIXED = {"dpo.loss_type": ["sigmoid", "ipo"], "dpo.loss_weights": [0.7, 0.3]}
ADAPTER = "--adapter"  # a scenario's override taking the worker's --adapter folder


def mesh_scenario(mesh: str, overrides: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(model, data, overrides) of a 4-rank mesh: the MoE one on its own model and full rows."""
    moe = mesh.startswith("moe")
    return ("moe" if moe else "llama", "full" if moe else "pairs", {**MESHES[mesh], **overrides})


# name: (model, data, overrides); model "llama" or "moe", data "pairs", "full" (every sequence
# fills max_len), "equal" (chosen = rejected)
SCENARIOS: dict[int, dict[str, tuple[str, str, dict[str, Any]]]] = {
    1: {
        "1x1_sigmoid": ("llama", "pairs", SIGMOID),
        "1x1_ipo": ("llama", "pairs", IPO),
        "1x1_hinge": ("llama", "pairs", {"dpo.loss_type": "hinge"}),
        "1x1_robust": ("llama", "pairs", {"dpo.loss_type": "robust", "dpo.label_smoothing": 0.2}),
        "1x1_rpo": ("llama", "pairs", {"dpo.sft_weight": 0.5}),
        "1x1_mixed": ("llama", "pairs", MIXED),
        "1x1_packed": ("llama", "pairs", {"data.packing": True}),
        "1x1_live": ("llama", "pairs", {"dpo.reference": "live"}),
        "1x1_equal": ("llama", "equal", {"data.packing": True}),
        # from a non-zero PEFT adapter: dpo.reference=auto takes precompute, the starting adapter (TRL's)
        "1x1_lora_adapter": ("llama", "pairs", {"lora.adapter": ADAPTER}),
    },
    4: {
        **{
            f"{mesh}_{loss}": mesh_scenario(mesh, kind)
            for mesh in MESHES
            for loss, kind in (("sigmoid", SIGMOID), ("ipo", IPO))
        },
        # checkpointed at step 2, then rerun from there to the end on another mesh
        "resumed": mesh_scenario("dp4", {"checkpoint.every": 2}),
    },
}
RESUMED_ON = MESHES["tp2_dp2"]


def dpo_config(model_dir: Path, data: Path, overrides: dict[str, Any]) -> PreferenceConfig:
    base = parity_config(model_dir, 1, 1)
    config = PreferenceConfig(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})
    for key, value in {**BASE, "data.path": str(data), **overrides}.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)
    return config


def run(config: PreferenceConfig, out: Path, device: torch.device, resume: Path | None = None) -> list[dict]:
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    return train(config, shape, model_config, device, out, resolved={}, resume_from=resume).history


def scenario(
    name: str, spec: tuple, models: dict, data: dict, out: Path, device: torch.device, adapter: Path
) -> dict:
    model, pairs, overrides = spec
    overrides = {key: str(adapter) if value == ADAPTER else value for key, value in overrides.items()}
    config = dpo_config(models[model], data[pairs], overrides)
    saved: dict[str, Any] = {}
    if "lora.r" in overrides:  # dtrain's initial adapters, by PEFT's names (B is zero): TRL starts from them
        saved["adapters"] = peft_tensors(sharded_model(config, device))
    saved["history"] = run(config, out / name, device)
    if name == "resumed":  # what followed step 2 is lost (a kill); the same folder resumed on another mesh
        table = out / name / "reference_logps.safetensors"
        before = table.stat().st_mtime_ns, table.read_bytes()
        config = dpo_config(models[model], data[pairs], {**overrides, **RESUMED_ON})
        resumed = run(config, out / name, device, out / name / "checkpoints" / "step-00000002")
        saved["history"] = saved["history"][:2] + resumed
        saved["table_unchanged"] = before == (table.stat().st_mtime_ns, table.read_bytes())
    return saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name in ("llama", "moe", "pairs", "full", "equal", "adapter"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    logging.getLogger("dtrain").setLevel(logging.WARNING)
    wanted = set(filter(None, args.only.split(",")))
    models = {"llama": args.llama, "moe": args.moe}
    data = {"pairs": args.pairs, "full": args.full, "equal": args.equal}
    results = {
        name: scenario(name, spec, models, data, args.out, device, args.adapter)
        for name, spec in SCENARIOS[dist.get_world_size()].items()
        if not wanted or name in wanted
    }
    save_results(results, args.out)


if __name__ == "__main__":
    main()
