"""Launched by tests/test_estimate.py under torchrun (gloo, real tensors): the planner's scenarios
for real. For each, the trainer's mesh, model and optimizer, one warm-up step on real data (each
rank's part of it: with context parallel its tokens of every row, as the trainer takes them), then
one full step (every micro-batch of it) under the same FSDPMemTracker the planner uses.

Rank 0 writes `<out>/<name>.json`: the tracker's figures, and the bytes of the real sharded
tensors counted from their storages (independent of the tracker).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.checks import check_config
from dtrain.data.formats import load_tokenizer
from dtrain.data.pipeline import build_data
from dtrain.distributed import build_parallel, init_distributed
from dtrain.estimate.app import compose
from dtrain.estimate.measure import track_step
from dtrain.loss import IGNORE
from dtrain.model import build_model, load_model_config, tokenizer_source
from dtrain.optim import build_optimizer
from dtrain.step import local_micro_batch, micro_step, optimizer_step
from tests.estimate_scenarios import SCENARIOS


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def run(overrides: list[str], device: torch.device) -> dict:
    config = compose(overrides)
    model_config = load_model_config(config.model)
    parallel = build_parallel(check_config(config, dist.get_world_size(), model_config), device)
    model = build_model(model_config, config, parallel, device)  # the CPU's kernel: sdpa
    model.train()
    optimizer = build_optimizer(model, config.optim)
    params = list(model.parameters())

    tokenizer = load_tokenizer(tokenizer_source(config.model))
    train = config.train
    batches = build_data(config.data, train, tokenizer, parallel.dp_rank, parallel.dp_size).train

    def step_batches(step: int) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        micro_batches = [local_micro_batch(mb, parallel) for mb in batches.next_step()]  # in order
        tokens = sum((mb["labels"] != IGNORE).sum() for mb in micro_batches).float()
        dist.all_reduce(tokens, group=parallel.token_group)
        return micro_batches, tokens

    loss_parallel, max_norm = config.parallel.loss_parallel, config.optim.max_grad_norm
    impl, chunk = config.parallel.loss_impl, config.parallel.loss_chunk  # the planner's loss
    micro_batches, tokens = step_batches(0)  # warm-up, as the planner does
    for mb in micro_batches:
        micro_step(model, mb, tokens, loss_parallel, impl, chunk)
    optimizer_step(optimizer, params, max_norm)
    micro_batches, tokens = step_batches(1)
    tracked = track_step(
        model, optimizer, micro_batches, tokens, loss_parallel, max_norm, loss_impl=impl, loss_chunk=chunk
    )

    micro_step(model, micro_batches[0], tokens, loss_parallel, impl, chunk)  # gradients to count
    real = {
        "params": storage_bytes([*model.parameters(), *model.buffers()]),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(
            value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        ),
    }
    step = asdict(tracked)
    step.pop("modules")
    return {"real": real, "tracked": step, "accumulation": len(micro_batches)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    for name, overrides in SCENARIOS.items():
        result = run(overrides, device)
        if dist.get_rank() == 0:
            (args.out / f"{name}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
