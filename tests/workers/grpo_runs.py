"""Launched by tests/test_grpo.py by run_worker (1 and 4 processes): every dtrain.grpo scenario of that
world size on one process group, through the real trainer, its completions from the file engine (the
fixed completions TRL gets too). Rank 0 saves `<out>/<name>.pt`: the logged history, the run's
rollouts.jsonl, and for LoRA the initial adapters (TRL starts from them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.checks import check_config
from dtrain.config import GRPORunConfig
from dtrain.distributed import init_distributed
from dtrain.model import load_model_config
from dtrain.parallel.lora import peft_tensors
from dtrain.trainer import train
from tests.helpers import parity_config, save_results, sharded_model

STEPS, GLOBAL_BATCH, G, MAX_COMPLETION, MAX_LEN, LR = 3, 8, 4, 6, 32, 1e-3
FUNCS = ["tests.test_grpo_reference:length_reward", "tests.test_grpo_reference:letter_reward"]
WEIGHTS = [1.0, 0.5]
# The run TRL must reproduce: fp32, AdamW (0.9, 0.95) without decay, clip 1.0, cosine from step 1, the
# prompts in file order; per dp rank micro-batches of half its completions (accumulation 2) unless said.
BASE = {"data.format": "prompt", "data.shuffle": False, "data.max_len": MAX_LEN}
BASE |= {"parallel.loss_impl": "auto", "optim.lr": LR, "optim.weight_decay": 0.0, "optim.warmup_steps": 0}
BASE |= {"train.max_steps": STEPS, "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": 4}
BASE |= {"grpo.num_generations": G, "grpo.max_completion_length": MAX_COMPLETION, "rollout.engine": "file"}
PACKED = {"data.packing": True}
BASE |= {"grpo.reward_funcs": FUNCS, "grpo.reward_weights": WEIGHTS, "moe.aux_scope": "global_batch"}
LORA = {"lora.r": 4, "lora.alpha": 8.0}
KL = {"grpo.beta": 0.04}
MU2 = {"grpo.num_iterations": 2}
GSPO = {"grpo.importance_sampling_level": "sequence", "grpo.loss_type": "grpo"}
SPG2 = {"grpo.steps_per_generation": 2}
HF = {"rollout.engine": "hf", **MU2, **KL}
RESUME = {"checkpoint.every": 1, "checkpoint.keep": 3}
MESHES = {  # 4 ranks
    "dp4": {"parallel.dp_shard": 4, "train.micro_batch_size": 1},
    "tp2_dp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 2},  # sequence parallel
    "cp2_tp2": {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1, "data.packing": True},
    "hsdp": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1},
}
# name: (model, overrides); model "llama" or "moe". Each scenario tries several settings at once.
SCENARIOS: dict[int, dict[str, tuple[str, dict[str, Any]]]] = {
    1: {
        "1x1_dapo_kl": ("llama", KL),
        "1x1_bnpo_none_packed": ("llama", {"grpo.loss_type": "bnpo", "grpo.scale_rewards": "none"} | PACKED),
        "1x1_grpo_mu2_kl": ("llama", {"grpo.loss_type": "grpo", **MU2, **KL}),
        "1x1_dr_grpo_masked_batch": (
            "llama",
            {
                "grpo.loss_type": "dr_grpo",
                "grpo.mask_truncated_completions": True,
                "grpo.scale_rewards": "batch",
            },
        ),
        "1x1_gspo_clip_higher": (
            "llama",
            {**GSPO, **MU2, "grpo.epsilon_high": 0.28, "grpo.delta": 1.5, "optim.lr": 3e-3},
        ),
        "1x1_spg2": ("llama", SPG2),
        "1x1_lora_kl": ("llama", {**LORA, **KL}),
        "1x1_moe": ("moe", {"train.micro_batch_size": 8}),
        # transformers' generate on the policy (rollout.engine=hf): the same completions on every mesh
        "1x1_hf": ("llama", HF),
    },
    4: {
        # the done-when case: accumulation 2, dapo, beta 0.04
        "tp2_dp2_dapo_kl": ("llama", {**MESHES["tp2_dp2"], **KL}),
        "cp2_tp2_gspo_kl": ("llama", {**MESHES["cp2_tp2"], **GSPO, **MU2, **KL}),
        "hsdp_spg2": ("llama", {**MESHES["hsdp"], **SPG2}),
        "lora_tp2_dp2": ("llama", {**MESHES["tp2_dp2"], **LORA, **KL}),
        "moe_ep2_tp2": ("moe", {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.ep": 2}),
        "tp2_dp2_hf": ("llama", {**MESHES["tp2_dp2"], **HF}),
        "hf_resumed": ("llama", {**MESHES["dp4"], **HF, **RESUME}),
        # checkpointed after step 1, in the middle of a generation (mu 2: steps 1-2), then rerun on another
        # mesh from there
        "resumed": ("llama", {**MESHES["dp4"], "grpo.loss_type": "grpo", **MU2, **KL, **RESUME}),
    },
}
RESUMED_ON = MESHES["tp2_dp2"]


def grpo_config(model_dir: Path, data: Path, completions: Path, overrides: dict[str, Any]) -> GRPORunConfig:
    base = parity_config(model_dir, 1, 1)
    config = GRPORunConfig(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})
    settings = {**BASE, "data.path": str(data), "rollout.path": str(completions), **overrides}
    for key, value in settings.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)
    return config


def run(config: GRPORunConfig, out: Path, device: torch.device, resume: Path | None = None) -> list[dict]:
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    return train(config, shape, model_config, device, out, resolved={}, resume_from=resume).history


def scenario(name: str, spec: tuple, models: dict, args: argparse.Namespace, device: torch.device) -> dict:
    model, overrides = spec
    config = grpo_config(models[model], args.data, args.completions, overrides)
    saved: dict[str, Any] = {}
    if "lora.r" in overrides:  # dtrain's initial adapters, by PEFT's names (B is zero): TRL starts from them
        saved["adapters"] = peft_tensors(sharded_model(config, device))
    saved["history"] = run(config, args.out / name, device)
    if name in (
        "resumed",
        "hf_resumed",
    ):  # what followed step 1 is lost (a kill); the same folder resumed on another mesh
        config = grpo_config(models[model], args.data, args.completions, {**overrides, **RESUMED_ON})
        resumed = run(config, args.out / name, device, args.out / name / "checkpoints" / "step-00000001")
        saved["history"] = saved["history"][:1] + resumed
    if dist.get_rank() == 0:
        rollouts = args.out / name / "rollouts.jsonl"
        saved["rollouts"] = [json.loads(line) for line in rollouts.read_text().splitlines()]
    return saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name in ("llama", "moe", "data", "completions"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    logging.getLogger("dtrain").setLevel(logging.WARNING)
    wanted = set(filter(None, args.only.split(",")))
    models = {"llama": args.llama, "moe": args.moe}
    results = {
        name: scenario(name, spec, models, args, device)
        for name, spec in SCENARIOS[dist.get_world_size()].items()
        if not wanted or name in wanted
    }
    save_results(results, args.out)


if __name__ == "__main__":
    main()
