"""Llama-3-8B on the meta device with a fake process group: per-rank sharded bytes for several
(world, tp). Prints one JSON object per configuration. Launched by tests/test_scale.py."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtrain.config import Config, MeshShape, ModelConfig, ParallelConfig, TrainConfig
from dtrain.distributed import build_parallel
from dtrain.model import build_model, load_model_config

settings = ModelConfig(name_or_path=sys.argv[1], init="random")
for world, tp in [(4, 2), (4, 4), (8, 4), (8, 8), (64, 8)]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    model_config = load_model_config(settings, offline=True)
    parallel = build_parallel(MeshShape(1, world // tp, 1, tp), torch.device("cpu"))
    config = Config(
        parallel=ParallelConfig(tp=tp, activation_checkpointing="full"), train=TrainConfig(precision="bf16")
    )
    model = build_model(model_config, config, parallel, device=None)  # stays on the meta device
    local = {n: p.to_local().numel() * p.element_size() for n, p in model.named_parameters()}
    total = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    assert all(isinstance(p, DTensor) for p in model.parameters())
    print(json.dumps({"world": world, "tp": tp, "local": local, "total": total}), flush=True)
    dist.destroy_process_group()
