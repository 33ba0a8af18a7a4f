"""Llama-3-8B on the meta device with a fake process group: per-rank sharded bytes for several
(world, tp), and for LoRA (r=16 on every projection, bf16 run) at world 4, tp 2. Prints one JSON
object per configuration. Launched by tests/test_scale.py."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtrain.config import Config, LoraConfig, MeshShape, ModelConfig, ParallelConfig, TrainConfig
from dtrain.distributed import build_parallel
from dtrain.model import build_model, load_model_config

settings = ModelConfig(name_or_path=sys.argv[1], init="random")
for world, tp, r in [(4, 2, 0), (4, 4, 0), (8, 4, 0), (8, 8, 0), (64, 8, 0), (4, 2, 16)]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    model_config = load_model_config(settings, offline=True)
    parallel = build_parallel(MeshShape(1, world // tp, 1, tp), torch.device("cpu"))
    config = Config(
        parallel=ParallelConfig(tp=tp, activation_checkpointing="full"),
        train=TrainConfig(precision="bf16"),
        lora=LoraConfig(r=r, alpha=2.0 * r),
    )
    model = build_model(model_config, config, parallel, device=None)  # stays on the meta device
    local = {n: p.to_local().numel() * p.element_size() for n, p in model.named_parameters()}
    total = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    assert all(isinstance(p, DTensor) for p in model.parameters())
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    dtypes = sorted({str(p.dtype) for n, p in model.named_parameters() if n in frozen})
    plan = {"world": world, "tp": tp, "r": r, "local": local, "total": total, "frozen": sorted(frozen)}
    print(json.dumps({**plan, "frozen_dtypes": dtypes}), flush=True)
    dist.destroy_process_group()
