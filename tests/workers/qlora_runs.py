"""Launched by tests/test_qlora.py by run_worker: every QLoRA scenario (lora.base_dtype=nf4) for this
world size on one process group, through dtrain's trainer. Rank 0 saves `<out>/<name>.pt`: each NF4
weight gathered in bitsandbytes' QuantState layout and dequantized (whole), the NF4 storage bytes of
every rank, the logged history, the trained adapters (PEFT's names) and logits, the dtypes, and the
bytes of FSDP's all-gathers a step. The 4-rank launch ends with the README's QLoRA command line
(dtrain.sft's main on these ranks), then rank 0 saves `<out>/torch_warnings.json`: what torch's
DTensor redistribution logged on it (the exports gather (_StridedShard, Shard) adapters). The
pytest side compares them with bitsandbytes and with PEFT.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dtrain.checks import check_config
from dtrain.distributed import init_distributed
from dtrain.model import canonical_name, load_model_config
from dtrain.parallel import lora, qlora
from dtrain.trainer import train
from tests.helpers import sharded_model
from tests.workers.lora_runs import COMPILE_BACKEND, EXPORT, apply_overrides, full, logits, lora_config

STEPS = 10
# 10 steps of GLOBAL_BATCH rows: two micro-batches of 4 at 1x1 (accumulation), one a step elsewhere
TRAINED = {"train.max_steps": STEPS, "train.micro_batch_size": 4}
# name: (dp, tp, overrides, train); all start from the PEFT-written adapter (non-zero A and B), fp32
SCENARIOS = {
    1: {"1x1": (1, 1, {**TRAINED, "parallel.compile": True}, True)},  # compiled layers: COMPILE_BACKEND
    4: {
        "2x2": (2, 2, {**TRAINED, **EXPORT}, True),  # o_proj, down_proj: blocks across tp ranks and rows
        "4x1": (4, 1, {**TRAINED, "train.micro_batch_size": 2}, True),  # FSDP only: all-gathers counted
        "1x4": (1, 4, {}, False),  # quantization only: the narrowest tp-local rows
        "2x2_bf16": (2, 2, {"train.precision": "bf16"}, False),  # quantized from the bf16 weights
    },
}
# The README's QLoRA line (after the model and data), for one step
README = "data.input_key=question parallel.tp=2 lora.r=16 lora.base_dtype=nf4 checkpoint.export_hf=true"
TINY_RUN = "train.max_steps=1"


def quantized(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Collective. Each NF4 weight whole: bitsandbytes' layout and its dequantized values."""
    return {
        name: {**qlora.bnb_quant_state(param), "dequantized": full(qlora.dequantized(param))}
        for name, param in qlora.nf4_parameters(model).items()
    }


def per_rank(value: object) -> list:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class AllGatherBytes:
    """Counts the bytes of the output of every `dist.all_gather_single` (what FSDP2's parameter
    all-gathers call, torch 2.13)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.original = dist.all_gather_single

    def __enter__(self) -> AllGatherBytes:
        def counting(output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self.sizes.append(output.numel() * output.element_size())
            return self.original(output, *args, **kwargs)

        dist.all_gather_single = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self.original


def run(name: str, dp: int, tp: int, overrides: dict, trained: bool, args, device) -> dict:  # noqa: ANN001
    config = lora_config(args.models / "llama", args.data, dp, tp, "adapter")
    config.lora.base_dtype = "nf4"
    apply_overrides(config, overrides)
    run_dir = args.out / name
    config.checkpoint.dir = str(run_dir / "checkpoints")
    saved: dict = {}
    if trained:
        model_config = load_model_config(config.model)
        shape = check_config(config, dist.get_world_size(), model_config)
        resolved = OmegaConf.to_container(OmegaConf.structured(config))
        with AllGatherBytes() as gathers:
            result = train(config, shape, model_config, device, run_dir, resolved=resolved)
        model = result.model  # training leaves the NF4 base as loaded (and every layer resharded)
        saved["all_gather_bytes"] = gathers.sizes
        saved["history"] = result.history
        saved["adapters"] = lora.peft_tensors(model)
        saved["run_dir"] = str(run_dir)
        if config.parallel.compile:  # the graphs compiled: parity held with the layers compiled
            saved["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    else:
        model = sharded_model(config, device)
    saved["quantized"] = quantized(model)
    saved["storage_bytes"] = per_rank(qlora.storage_bytes(model))
    saved["dtypes"] = {canonical_name(n): p.dtype for n, p in model.named_parameters()}
    saved["nf4"] = sorted(qlora.nf4_parameters(model))
    if trained:  # last: the last layer keeps its gathered (dense) weights after an eval forward
        saved["trained_logits"] = logits(model)
    return saved


def main() -> None:
    torch.compile = functools.partial(torch.compile, backend=COMPILE_BACKEND)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, required=True, help="llama/ with its PEFT adapter/")
    parser.add_argument("--data", type=Path, required=True)
    args = parser.parse_args()
    redistribution = Recorded()
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(redistribution)
    device = init_distributed(timeout_s=300)
    world = dist.get_world_size()
    for name, scenario in SCENARIOS[world].items():
        saved = run(name, *scenario, args, device)
        if dist.get_rank() == 0:
            torch.save(saved, args.out / f"{name}.pt")
    dist.barrier()
    if world == 4:  # the README's command line, as `torchrun --nproc_per_node=4 -m dtrain.sft ...` runs it
        from dtrain import sft  # on this process group (as a sweep's jobs share one); it ends the group

        model, data = args.models / "llama", args.data
        sys.argv = ["dtrain.sft", f"model.name_or_path={model}", f"data.path={data}", *README.split()]
        sys.argv += [TINY_RUN, f"hydra.run.dir={args.out / 'readme'}"]
        sft.main()
        if int(os.environ["RANK"]) == 0:
            (args.out / "torch_warnings.json").write_text(json.dumps(redistribution.messages))
    else:
        dist.destroy_process_group()


class Recorded(logging.Handler):
    """A logger's records at WARNING and above, as messages."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
