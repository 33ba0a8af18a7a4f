"""Launched by tests/test_dpo.py by run_worker (1 and 4 processes): every dtrain.dpo scenario of
that world size on one process group, through the real trainer. Rank 0 saves `<out>/<name>.pt`: the
logged history, the start line (the run's summary), for LoRA the initial adapters (the TRL reference
starts from them), and for the resumed runs what happened to the reference table. The pytest side
compares them with TRL's DPOTrainer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Iterator
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
from tests.dpo_reference import ADAM_EPS
from tests.helpers import parity_config, save_results, sharded_model

STEPS, GLOBAL_BATCH, MAX_LEN, LR = 3, 8, 32, 3e-3
EVAL_EVERY = 1  # the eval scenarios evaluate after every step (TRL: eval_steps=1)
# The run TRL must reproduce: fp32, AdamW (0.9, 0.95, eps 1e-6) without decay, clip 1.0, cosine from
# step 1, the pairs in file order; per dp rank micro-batches of half its pairs (accumulation 2) unless
# said. eps 1e-6, not 1e-8: AdamW's first step moves every element by ±lr whatever its gradient's size,
# so an element whose gradient sits at the float noise floor (< 1e-8) goes where the noise says, and
# the next step's grad norm follows (tests/README.md's error model allows it in the weights, not in a
# step's figures): with another model as reference, step 2's grad norm moved 1.4e-5 relative from
# TRL's at eps 1e-8, 9e-7 at 1e-6.
BASE = {"data.format": "preference", "data.shuffle": False, "data.max_len": MAX_LEN}
BASE |= {"parallel.loss_impl": "auto", "optim.lr": LR, "optim.weight_decay": 0.0, "optim.warmup_steps": 0}
BASE |= {"optim.eps": ADAM_EPS}
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
ADAPTER, REF = "--adapter", "--ref"  # a scenario's override taking the worker's folder of that name
EVAL = {"data.eval_split": "test", "train.eval_every": EVAL_EVERY}
# Every DPOConfig key dtrain takes, in groups that run at 1×1 and at tp 2 × dp 2 (with accumulation)
# against one TRL run each (docs/dpo.md's table names each key's group); each loss weighted so that
# its term moves the loss and the gradient well above the tolerance.
GROUPS: dict[str, tuple[str, dict[str, Any]]] = {  # name: (data, overrides)
    # the losses of the chosen − rejected score difference; sft: RPO's NLL; an eval of held-out pairs
    # with the precomputed reference
    "pairwise": (
        "split",
        {
            "dpo.loss_type": ["sigmoid", "hinge", "ipo", "exo_pair", "robust", "discopop"]
            + ["sigmoid_norm", "sft"],
            "dpo.loss_weights": [1.0, 0.5, 0.02, 0.7, 0.6, 0.8, 0.9, 0.3],
            "dpo.label_smoothing": 0.1,
            "dpo.discopop_tau": 0.3,
            **EVAL,
        },
    ),
    # the losses of each side's log-ratio, WPO-weighted, with LD-DPO's length weighting
    "per_side": (
        "pairs",
        {
            "dpo.loss_type": ["nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down"],
            "dpo.loss_weights": [1.0, 0.6, 0.02, 0.8, 0.7],
            "dpo.use_weighting": True,
            "dpo.ld_alpha": 0.5,
        },
    ),
    # the two losses that sort the step's log-ratios
    "sorted": (
        "pairs",
        {"dpo.loss_type": ["aot", "aot_unpaired"], "dpo.loss_weights": [1.0, 0.5]}
        | {"dpo.label_smoothing": 0.1},
    ),
    # WPO on js_divergence's scores
    "wpo_js": (
        "pairs",
        {"dpo.loss_type": ["sigmoid", "sigmoid_norm"], "dpo.loss_weights": [1.0, 0.8]}
        | {"dpo.use_weighting": True, "dpo.f_divergence_type": "js_divergence"},
    ),
    # f-DPO's other two divergences
    "forward_kl": (
        "pairs",
        {"dpo.loss_type": ["sigmoid", "hinge"], "dpo.loss_weights": [1.0, 0.5]}
        | {"dpo.f_divergence_type": "forward_kl"},
    ),
    "alpha": (
        "pairs",
        {"dpo.loss_type": ["sigmoid", "ipo"], "dpo.loss_weights": [1.0, 0.05]}
        | {"dpo.f_divergence_type": "alpha_divergence", "dpo.f_alpha_divergence_coef": 0.3},
    ),
    # TR-DPO: the live reference mixed with the policy after every step; an eval under the moved reference
    "tr_dpo": (
        "split",
        {"dpo.sync_ref_model": True, "dpo.ref_model_mixup_alpha": 0.6, "dpo.ref_model_sync_steps": 1, **EVAL},
    ),
    # TRL's ref_model: the reference is another folder's model (precompute at 1×1, live at tp 2 × dp 2)
    "ref_model": ("pairs", {"dpo.ref_model": REF}),
}
# how each group's 1×1 and tp 2 × dp 2 runs differ besides the mesh: the dense loss's WPO at 1×1 and
# the fused one's on packed rows at tp 2 × dp 2; the other folder's reference precomputed, then live
GROUP_MESHES = {
    "1x1": {"per_side": {"parallel.loss_impl": "dense"}},
    "tp2_dp2": {
        "per_side": {"data.packing": True},
        "ref_model": {"dpo.reference": "live"},
        "tr_dpo": {"checkpoint.every": 2},  # resumed from step 2 on dp_shard 4 (resumed_tr_dpo)
    },
}


def mesh_scenario(mesh: str, overrides: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(model, data, overrides) of a 4-rank mesh: the MoE one on its own model and full rows."""
    moe = mesh.startswith("moe")
    return ("moe" if moe else "llama", "full" if moe else "pairs", {**MESHES[mesh], **overrides})


def group_scenarios(mesh: str, mesh_overrides: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Every group's scenario on `mesh` (1x1 or tp2_dp2)."""
    return {
        f"{mesh}_{group}": ("llama", data, mesh_overrides | settings | GROUP_MESHES[mesh].get(group, {}))
        for group, (data, settings) in GROUPS.items()
    }


# name: (model, data, overrides); model "llama" or "moe", data "pairs", "full" (every sequence
# fills max_len), "split" (train and held-out test pairs)
SCENARIOS: dict[int, dict[str, tuple[str, str, dict[str, Any]]]] = {
    1: {
        "1x1_sigmoid": ("llama", "pairs", SIGMOID),
        "1x1_packed": ("llama", "pairs", {"data.packing": True}),
        "1x1_live": ("llama", "pairs", {"dpo.reference": "live"}),
        # from a non-zero PEFT adapter: dpo.reference=auto takes precompute, the starting adapter (TRL's);
        # live takes a frozen copy of the starting adapter, the same reference
        "1x1_lora_adapter": ("llama", "pairs", {"lora.adapter": ADAPTER}),
        "1x1_lora_adapter_live": ("llama", "pairs", {"lora.adapter": ADAPTER, "dpo.reference": "live"}),
        **group_scenarios("1x1", {}),
    },
    4: {
        **{
            f"{mesh}_{loss}": mesh_scenario(mesh, kind)
            for mesh in MESHES
            for loss, kind in (("sigmoid", SIGMOID), ("ipo", IPO))
            if (mesh, loss) != ("tp2_dp2", "ipo")  # there: the pairwise and alpha groups' ipo
        },
        **group_scenarios("tp2_dp2", MESHES["tp2_dp2"]),
        # checkpointed at step 2, then rerun from there to the end on another mesh: in the same folder,
        # into a new folder (checkpoint.resume=PATH), and in the same folder after its reference table
        # was truncated on disk
        "resumed": mesh_scenario("dp4", {"checkpoint.every": 2}),
    },
}
RESUMED_ON = MESHES["tp2_dp2"]
TABLE = "reference_logps.safetensors"


def dpo_config(model_dir: Path, data: Path, overrides: dict[str, Any]) -> PreferenceConfig:
    base = parity_config(model_dir, 1, 1)
    config = PreferenceConfig(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})
    for key, value in {**BASE, "data.path": str(data), **overrides}.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)
    return config


class Lines(logging.Handler):
    """The dtrain logger's lines while it is installed (info and above)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def captured() -> Iterator[list[str]]:
    logger, handler = logging.getLogger("dtrain"), Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run(config: PreferenceConfig, out: Path, device: torch.device, resume: Path | None = None) -> dict:
    """The run's history, its dtrain log lines (rank 0's) and the warnings dtrain's own code raised."""
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    with captured() as lines, warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        history = train(config, shape, model_config, device, out, resolved={}, resume_from=resume).history
    own = [f"{w.filename}:{w.lineno}: {w.message}" for w in raised if f"{os.sep}dtrain{os.sep}" in w.filename]
    return {"history": history, "lines": lines, "warnings": own}


def scenario(name: str, spec: tuple, models: dict, data: dict, out: Path, device: torch.device) -> dict:
    model, pairs, overrides = spec
    folders = {ADAPTER: str(models["adapter"]), REF: str(models["ref"])}
    overrides = {
        key: folders.get(value, value) if isinstance(value, str) else value
        for key, value in overrides.items()
    }
    config = dpo_config(models[model], data[pairs], overrides)
    saved: dict[str, Any] = {}
    if "lora.r" in overrides:  # dtrain's initial adapters, by PEFT's names (B is zero): TRL starts from them
        saved["adapters"] = peft_tensors(sharded_model(config, device))
    first = run(config, out / name, device)
    start = next((line for line in first["lines"] if line.startswith("model ")), "")  # rank 0's summary line
    saved |= {"history": first["history"], "start": start, "warnings": first["warnings"]}
    if name == "resumed":
        saved |= resumed(models[model], data[pairs], overrides, out, saved["history"], device)
    if name == "tp2_dp2_tr_dpo":  # the moved reference is in the checkpoint: resumed on dp_shard 4
        config = dpo_config(models[model], data[pairs], {**overrides, "parallel.tp": 1, **MESHES["dp4"]})
        checkpoint = out / name / "checkpoints" / "step-00000002"
        again = run(config, out / name, device, checkpoint)["history"]
        saved["resumed"] = [record for record in first["history"] if record["step"] <= 2] + again
    return saved


def resumed(model: Path, pairs: Path, overrides: dict, out: Path, whole: list, device: torch.device) -> dict:
    """What followed step 2 is lost (a kill): rerun from the step-2 checkpoint on another mesh, in the
    same folder; into a new folder (checkpoint.resume=PATH); in the same folder with its reference
    table truncated on disk. Each: the whole curve (the first two steps from the run itself), the log
    lines, and what happened to the tables."""
    folder, checkpoint = out / "resumed", out / "resumed" / "checkpoints" / "step-00000002"
    table = folder / TABLE
    config = lambda: dpo_config(model, pairs, {**overrides, **RESUMED_ON})  # noqa: E731
    before = table.stat().st_mtime_ns, table.read_bytes()
    same = run(config(), folder, device, checkpoint)
    result = {"same": {**same, "history": whole[:2] + same["history"]}}
    result["table_unchanged"] = before == (table.stat().st_mtime_ns, table.read_bytes())
    elsewhere = run(config(), out / "resumed_new", device, checkpoint)
    result["new_folder"] = {**elsewhere, "history": whole[:2] + elsewhere["history"]}
    result["copied"] = (out / "resumed_new" / TABLE).read_bytes() == before[1]
    if dist.get_rank() == 0:  # a table cut short on disk (a full disk, a copy interrupted)
        table.write_bytes(before[1][: len(before[1]) // 2])
    dist.barrier()
    truncated = run(config(), folder, device, checkpoint)
    result["truncated"] = {**truncated, "history": whole[:2] + truncated["history"]}
    result["set_aside"] = (folder / f"unreadable-{TABLE}").read_bytes() == before[1][: len(before[1]) // 2]
    result["rewritten"] = len(table.read_bytes()) == len(before[1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name in ("llama", "moe", "ref", "pairs", "full", "split", "adapter"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    logging.getLogger("dtrain").setLevel(logging.WARNING)
    wanted = set(filter(None, args.only.split(",")))
    models = {"llama": args.llama, "moe": args.moe, "ref": args.ref, "adapter": args.adapter}
    data = {"pairs": args.pairs, "full": args.full, "split": args.split}
    results = {
        name: scenario(name, spec, models, data, args.out, device)
        for name, spec in SCENARIOS[dist.get_world_size()].items()
        if not wanted or name in wanted
    }
    save_results(results, args.out)


if __name__ == "__main__":
    main()
