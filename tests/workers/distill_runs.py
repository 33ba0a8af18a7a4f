"""Launched by tests/test_distill.py by run_worker (1 and 4 processes): every dtrain.distill scenario of
that world size on one process group, through the real trainer (offline on the records' completions;
on-policy with the file engine replaying fixed completions, or the hf engine sampling), and at 4
ranks the fused divergence alone on tp 2 and 4. Rank 0 saves `<out>/<name>.pt`: a run's logged
history (for LoRA the initial adapters too, which TRL starts from; the names of the NF4 weights), or a
divergence case's loss, figures and gradients (gathered). The pytest side compares them with TRL's
trainers and TRL's dense divergence.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dtrain.checks import check_config
from dtrain.config import DistillationConfig
from dtrain.distributed import init_distributed
from dtrain.fused_divergence import Divergence, Logits, fused_divergence
from dtrain.loss import IGNORE
from dtrain.model import load_model_config
from dtrain.parallel import qlora
from dtrain.parallel.lora import peft_tensors
from dtrain.trainer import train
from tests.helpers import parity_config, save_results, sharded_model

STEPS, GLOBAL_BATCH, MAX_LEN, LR, T = 3, 4, 32, 1e-3, 2.0
# The run TRL must reproduce: fp32, AdamW (0.9, 0.95) without decay, clip 1.0, cosine from step 1, the
# records in file order, the whole global batch in one TRL micro-batch; dtrain's own split below.
BASE = {"data.format": "prompt_completion", "data.shuffle": False, "data.max_len": MAX_LEN}
BASE |= {"optim.lr": LR, "optim.weight_decay": 0.0, "optim.warmup_steps": 0}
BASE |= {"parallel.loss_impl": "auto", "parallel.loss_chunk": 8}
BASE |= {"train.max_steps": STEPS, "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": 2}
BASE |= {"distill.temperature": T}
LORA = {"lora.r": 4, "lora.alpha": 8.0}
BETA = {beta: {"distill.beta": beta} for beta in (0.0, 0.5, 1.0)}
MAX_COMPLETION = 10  # the fixed completions of 3 to 12 tokens: some cut without their EOS
ROLLOUTS = "--rollouts"  # the worker's --rollouts file (the fixed completions, a line per record)
# on-policy every step on the prompts alone, the file engine replaying the fixed completions
ON_POLICY = {"distill.on_policy": 1.0, "rollout.engine": "file", "rollout.path": ROLLOUTS}
ON_POLICY |= {"distill.max_completion_length": MAX_COMPLETION}
# half the steps sampled by the hf engine (seeded per step and example: the same on every mesh)
SAMPLED = {"distill.on_policy": 0.5, "rollout.engine": "hf", "distill.max_completion_length": 8}
MESHES = {  # 4 ranks; each with accumulation 2 but dp 4
    "dp4": {"parallel.dp_shard": 4, "train.micro_batch_size": 1},
    "tp2_dp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 1},  # sequence parallel
    "cp2_tp2": {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1, "data.packing": True},
}
# name: (data, overrides); data "records" (GKD's messages: prompts with their completions) or "prompts"
# (the same prompts alone, DistillationTrainer's format)
SCENARIOS: dict[int, dict[str, tuple[str, dict[str, Any]]]] = {
    1: {
        **{f"1x1_b{beta:g}": ("records", BETA[beta]) for beta in BETA},
        "1x1_packed": ("records", {**BETA[0.5], "data.packing": True, "train.micro_batch_size": 4}),
        "1x1_sft": ("records", {**BETA[0.5], "distill.sft_weight": 0.5}),
        "1x1_qlora": ("records", {**BETA[0.5], **LORA, "lora.base_dtype": "nf4"}),
        **{f"1x1_onpolicy_b{beta:g}": ("prompts", {**BETA[beta], **ON_POLICY}) for beta in BETA},
        "1x1_sampled": ("records", {**BETA[0.5], **SAMPLED}),
    },
    4: {
        "dp4_b0.5": ("records", {**MESHES["dp4"], **BETA[0.5]}),
        **{f"tp2_dp2_b{beta:g}": ("records", {**MESHES["tp2_dp2"], **BETA[beta]}) for beta in BETA},
        "cp2_tp2_b0.5": ("records", {**MESHES["cp2_tp2"], **BETA[0.5]}),
        "lora_tp2_dp2_b0.5": ("records", {**MESHES["tp2_dp2"], **BETA[0.5], **LORA}),
        "tp2_dp2_onpolicy_b0.5": ("prompts", {**MESHES["tp2_dp2"], **BETA[0.5], **ON_POLICY}),
        "cp2_tp2_onpolicy_b1": ("prompts", {**MESHES["cp2_tp2"], **BETA[1.0], **ON_POLICY}),
        "tp2_dp2_sampled": ("records", {**MESHES["tp2_dp2"], **BETA[0.5], **SAMPLED}),
    },
}


def distill_config(student: Path, teacher: Path, data: Path, overrides: dict[str, Any]) -> DistillationConfig:
    base = parity_config(student, 1, 1)
    fields = {field.name: getattr(base, field.name) for field in dataclasses.fields(base)}
    config = DistillationConfig(**fields)
    for key, value in {**BASE, "data.path": str(data), "distill.teacher": str(teacher), **overrides}.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)
    return config


def run(config: DistillationConfig, out: Path, device: torch.device) -> Any:
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    return train(config, shape, model_config, device, out, resolved={})


def scenario(name: str, spec: tuple, args: argparse.Namespace, device: torch.device) -> dict:
    data, overrides = spec
    overrides = {key: str(args.rollouts) if value == ROLLOUTS else value for key, value in overrides.items()}
    config = distill_config(args.student, args.teacher, getattr(args, data), overrides)
    saved: dict[str, Any] = {}
    if "lora.r" in overrides and "lora.base_dtype" not in overrides:  # TRL starts from dtrain's initial A
        saved["adapters"] = peft_tensors(sharded_model(config, device))
    result = run(config, args.out / name, device)
    saved["history"] = result.history
    saved["nf4"] = sorted(qlora.nf4_parameters(result.model))
    return saved


# ---------------------------------------------------------------------------------------------------
# The divergence alone

VOCAB, WIDTH, TEACHER_WIDTH, CHUNK = 1025, 16, 24, 5  # tp 2 pads the vocabulary to 1026 rows, tp 4 to 1028
# (tp, sequence parallel, beta, temperature, NLL weight, the student's logits, the teacher's)
GEMMA, GRANITE = Logits(1.0, 30.0), Logits(0.25)
DIVERGENCE_CASES = {
    f"tp{tp}_{'sp' if sp else 'rep'}_b{beta:g}": (tp, sp, beta, 1.0, 0.0, Logits(), Logits())
    for tp in (2, 4)
    for sp in (True, False)
    for beta in (0.0, 0.5, 1.0)
}
DIVERGENCE_CASES |= {
    "tp2_sp_b0.5_T2_nll": (2, True, 0.5, T, 0.3, Logits(), Logits()),
    "tp4_sp_b1_T0.7_softcap_nll": (4, True, 1.0, 0.7, 0.3, Logits(2.0, 3.0), GEMMA),
    "tp4_rep_b0_T2_scaled": (4, False, 0.0, T, 0.0, GRANITE, GRANITE),
}


def divergence_inputs(tp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same tensors on every rank and in the pytest process: hidden states of two widths, heads
    of the vocabulary padded for `tp` (zero rows past VOCAB), labels with ignored spans (a prompt, a
    padding tail) and the last real id among the targets (on the shard that holds the padding)."""
    generator = torch.Generator().manual_seed(seed)
    rows = -(-VOCAB // tp) * tp
    heads = []
    for width, scale in ((WIDTH, 0.3), (TEACHER_WIDTH, 0.5)):
        head = torch.zeros(rows, width)
        head[:VOCAB] = torch.randn(VOCAB, width, generator=generator) * scale
        heads.append(head)
    labels = torch.randint(0, VOCAB, (2, 32), generator=generator)
    labels[0, :7], labels[1, 25:] = IGNORE, IGNORE
    labels[1, 3] = VOCAB - 1
    return {
        "hidden": torch.randn(2, 32, WIDTH, generator=generator),
        "head": heads[0],
        "teacher_hidden": torch.randn(2, 32, TEACHER_WIDTH, generator=generator),
        "teacher_head": heads[1],
        "labels": labels,
    }


def divergence_case(case: tuple, tp_mesh) -> dict[str, Any]:  # noqa: ANN001
    """The fused divergence on `tp_mesh` (heads Shard(0); hidden states Shard(1) under sequence
    parallel, else replicated): its loss and figures, and its gradients gathered whole."""
    tp, sp, beta, temperature, weight, student, teacher = case
    inputs = divergence_inputs(tp)
    tensors = {}
    for name in ("hidden", "head", "teacher_hidden", "teacher_head"):
        value = inputs[name]
        if name.endswith("head"):
            value = distribute_tensor(value, tp_mesh, [Shard(0)])
        elif sp:
            value = distribute_tensor(value, tp_mesh, [Shard(1)])
        tensors[name] = value.detach().requires_grad_(name in ("hidden", "head"))
    settings = Divergence(beta, temperature, weight, student, teacher)
    loss, sums = fused_divergence(
        tensors["hidden"], tensors["head"], tensors["teacher_hidden"], tensors["teacher_head"],
        inputs["labels"], settings, CHUNK, VOCAB,
    )  # fmt: skip
    loss.backward()
    grads = [tensors[name].grad for name in ("hidden", "head")]
    grads = [grad.full_tensor() if isinstance(grad, DTensor) else grad for grad in grads]
    return {"loss": loss.item(), "sums": sums.tolist(), "grad_hidden": grads[0], "grad_head": grads[1]}


def divergence_cases(wanted: set[str]) -> dict[str, dict]:
    """Every case on this 4-rank world: tp 4 on all ranks, tp 2 on each half (2 × 2)."""
    meshes = {
        4: init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))["tp"],
        2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"],
    }
    return {
        f"divergence_{name}": divergence_case(case, meshes[case[0]])
        for name, case in DIVERGENCE_CASES.items()
        if not wanted or f"divergence_{name}" in wanted
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name in ("student", "teacher", "records", "prompts", "rollouts"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    logging.getLogger("dtrain").setLevel(logging.WARNING)
    wanted = set(filter(None, args.only.split(",")))
    results = {
        name: scenario(name, spec, args, device)
        for name, spec in SCENARIOS[dist.get_world_size()].items()
        if not wanted or name in wanted
    }
    if dist.get_world_size() == 4:
        results |= divergence_cases(wanted)
    save_results(results, args.out)


if __name__ == "__main__":
    main()
