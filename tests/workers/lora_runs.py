"""Launched by tests/test_lora.py by run_worker: every LoRA scenario for this world size on one
process group, through dtrain's trainer. Rank 0 saves `<out>/<name>.pt` with the logged history, the
trained adapters and the base weights after training (full tensors, HF / PEFT names); the pytest
side compares them with single-process HF + peft.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor, Replicate

from dtrain.checks import check_config
from dtrain.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from dtrain.distributed import init_distributed
from dtrain.model import canonical_name, load_model_config
from dtrain.parallel import fused, lora
from dtrain.trainer import train
from tests.helpers import sharded_model

STEPS, GLOBAL_BATCH, MICRO_BATCH, MAX_LEN, LR = 6, 8, 2, 64, 3e-3
R, ALPHA = 8, 16.0
# The compiled scenario compiles with aot_eager, as bench/gpu_check.py's dry run does: Dynamo's capture
# of the adapters in each layer and AOT autograd run as on CUDA, Inductor's C++ code generation (half
# a minute of a fresh machine's CPU here, and not CUDA's Triton code anyway) does not; test_perf
# compiles the dense model through Inductor on the CPU.
COMPILE_BACKEND = "aot_eager"
EXPORT = {"checkpoint.export_hf": True, "checkpoint.export_merged": True, "checkpoint.export_dtype": "fp32"}
# dp = 1 meshes: 2 micro-batches of 4 rows a step, not 4 of 2 (accumulation at half the DTensor calls)
TWO_MICRO_BATCHES = {"train.micro_batch_size": GLOBAL_BATCH // 2}
PACKED_CP = {"parallel.cp": 2, "data.packing": True, **TWO_MICRO_BATCHES}
# name: (dp, tp, model, start, overrides); start "init" (PEFT's init, B zero) or "adapter" (the
# PEFT-written adapter of the model's folder, non-zero A and B). Each scenario adds what the others
# do not: a mesh, a family, or a feature (activation checkpointing, compile, cp, dropout, bf16).
SCENARIOS = {
    1: {
        "1x1": (1, 1, "llama", "init", {"parallel.compile": True}),  # see COMPILE_BACKEND
        "1x1_bf16": (1, 1, "llama", "init", {"train.precision": "bf16"}),
    },
    4: {
        # rsLoRA (alpha / sqrt(r)) from lora.use_rslora, exported and resumed (2x2_qwen3: from an adapter)
        "2x2": (2, 2, "llama", "init", {**EXPORT, "checkpoint.every": STEPS // 2, "lora.use_rslora": True}),
        "2x2_tied": (2, 2, "tied", "adapter", {}),
        "2x2_qwen3": (2, 2, "qwen3", "adapter", {}),
        # fused qkv_proj / gate_up_proj split under TP; resumed at tp = 1: the shared A in DCP and FSDP
        "2x2_phi3": (2, 2, "phi3", "adapter", {**EXPORT, "checkpoint.every": STEPS // 2}),
        "2x2_gemma3": (2, 2, "gemma3", "adapter", {"parallel.activation_checkpointing": "selective"}),
        "2x2_olmo2": (2, 2, "olmo2", "adapter", {"parallel.activation_checkpointing": "full"}),
        "4x1": (4, 1, "llama", "adapter", {}),
        "1x4": (1, 4, "llama", "adapter", TWO_MICRO_BATCHES),
        "cp2_tp2": (1, 2, "llama", "adapter", PACKED_CP),  # packed rows, documents across cp chunks
        "2x2_dropout": (2, 2, "llama", "init", {"lora.dropout": 0.2}),
    },
}


def lora_config(folder: Path, data: Path, dp: int, tp: int, start: str) -> Config:
    """fp32, accumulation, clipping, decay, warmup + cosine; the rows in the file's order."""
    settings = (
        LoraConfig(adapter=str(folder / "adapter")) if start == "adapter" else LoraConfig(r=R, alpha=ALPHA)
    )
    return Config(
        model=ModelConfig(name_or_path=str(folder), init="pretrained"),
        data=DataConfig(path=str(data), input_key="question", max_len=MAX_LEN, shuffle=False),
        parallel=ParallelConfig(tp=tp, dp_shard=dp),
        optim=OptimConfig(lr=LR, weight_decay=0.1, max_grad_norm=1.0, schedule="cosine", warmup_steps=2),
        train=TrainConfig(
            max_steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, precision="fp32"
        ),
        checkpoint=CheckpointConfig(resume="none", save_final=False),
        lora=settings,
    )


def apply_overrides(config: Config, overrides: dict) -> None:
    for key, value in overrides.items():
        group, name = key.split(".")
        setattr(getattr(config, group), name, value)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value, a DTensor gathered one mesh axis at a time: full_tensor() of FSDP-after-tp
    placements, (_StridedShard, Shard), logs torch's warning that test_qlora holds dtrain's exports to."""
    if isinstance(tensor, DTensor):
        placements = list(tensor.placements)
        for axis in range(len(placements)):
            placements[axis] = Replicate()
            tensor = tensor.redistribute(tensor.device_mesh, placements)
        tensor = tensor.to_local()
    return tensor.detach().clone()


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under the names PEFT saves them with (Phi-3: its fused projections' adapters,
    as the export writes them; test_lora checks the export against PeftModel.from_pretrained)."""
    return lora.peft_tensors(model)


def logit_ids() -> torch.Tensor:
    return torch.arange(2 * MAX_LEN).reshape(2, MAX_LEN) * 7 % 300


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    ids = logit_ids()
    out = full(model(input_ids=ids, position_ids=torch.arange(MAX_LEN).expand(len(ids), -1)).logits)
    model.train()
    return out


def masks_agree_over_tp(model: torch.nn.Module, parallel) -> bool:
    """One training forward: whether every tp rank of this group dropped the same inputs of layer 0's
    q_proj adapter (its input is replicated over tp, so its mask must be too)."""
    module = lora.adapter_modules(model)["model.layers.0.self_attn.q_proj"]
    captured = []
    dropout = module._dropout

    def capture(x: torch.Tensor) -> torch.Tensor:
        out = dropout(x)
        captured.append(full(out.to_local() if isinstance(out, DTensor) else out) == 0)
        return out

    module._dropout = capture
    ids = logit_ids()
    model(input_ids=ids, position_ids=torch.arange(MAX_LEN).expand(len(ids), -1))
    del module._dropout
    group = parallel["tp"].get_group()
    gathered = [torch.empty_like(captured[0]) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, captured[0].contiguous(), group=group)
    return all(torch.equal(mask, gathered[0]) for mask in gathered) and bool(captured[0].any())


def run(name, dp, tp, kind, start, overrides, args, device) -> dict:
    config = lora_config(args.models / kind, args.data, dp, tp, start)
    apply_overrides(config, overrides)
    run_dir = args.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    config.checkpoint.dir = str(run_dir / "checkpoints")
    saved: dict = {}
    if start == "init" and not overrides.keys() & {"lora.dropout", "train.precision"}:
        # the adapters as dtrain initialises them: the parity reference starts from these
        saved["init"] = adapters(sharded_model(config, device))
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    # the resolved config goes into each checkpoint, as the CLI's does: dtrain.export rebuilds from it
    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    result = train(config, shape, model_config, device, run_dir, resolved=resolved)
    saved["history"] = result.history
    saved["adapters"] = adapters(result.model)
    # under HF's names (Phi-3's split projections concatenated back) to compare with the files
    saved["base"] = fused.fuse(
        result.model,
        {canonical_name(n): full(p) for n, p in result.model.named_parameters() if not p.requires_grad},
    )
    saved["dtypes"] = {canonical_name(n): p.dtype for n, p in result.model.named_parameters()}
    saved["trainable"] = sorted(
        canonical_name(n) for n, p in result.model.named_parameters() if p.requires_grad
    )
    saved["optimizer_states"] = sum(len(state) > 0 for state in result.optimizer.state.values())
    saved["trained_logits"] = logits(result.model)
    saved["run_dir"] = str(run_dir)
    if config.parallel.compile:  # the graphs compiled: parity held with the layers compiled
        saved["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if config.lora.dropout > 0:
        saved["masks_agree"] = masks_agree_over_tp(result.model, result.parallel)
    if config.checkpoint.every:  # resume the middle checkpoint at tp = 1 over the same world
        step = config.checkpoint.every
        resume = Path(config.checkpoint.dir) / f"step-{step:08d}"
        config.parallel.tp, config.parallel.dp_shard = 1, dist.get_world_size()
        apply_overrides(config, {"checkpoint.export_hf": False, "checkpoint.export_merged": False})
        config.checkpoint.every, config.checkpoint.dir = 0, str(run_dir / "resumed_checkpoints")
        shape = check_config(config, dist.get_world_size(), model_config)
        resumed = train(config, shape, model_config, device, run_dir / "resumed", {}, resume_from=resume)
        saved["resumed_history"] = resumed.history
        saved["resumed_adapters"] = adapters(resumed.model)
    return saved


def main() -> None:
    torch.compile = functools.partial(torch.compile, backend=COMPILE_BACKEND)  # see COMPILE_BACKEND
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--models", type=Path, required=True, help="one folder per model kind, each with adapter/"
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    for name, scenario in SCENARIOS[dist.get_world_size()].items():
        if args.only and name not in args.only.split(","):
            continue
        saved = run(name, *scenario, args, device)
        if dist.get_rank() == 0:
            torch.save(saved, args.out / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
