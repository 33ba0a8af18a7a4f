"""Launched by tests/test_perf.py under torchrun with 4 processes (gloo): the 2×2 mesh, fp32.

Checks, each asserting on every rank (a failure exits non-zero):
- parallel.loss_chunk gives the loss and the gradients of the unchunked loss (1e-6), with a chunk
  that does not divide the local sequence shard (a short last chunk), in training and in eval.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import MAX_LEN, parity_config, sharded_model  # noqa: E402

from dtrain.data import IGNORE  # noqa: E402
from dtrain.distributed import init_distributed  # noqa: E402
from dtrain.loss import loss_context  # noqa: E402
from dtrain.trainer import micro_step, summed_loss  # noqa: E402

TOL = 1e-6


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def batch(seed: int) -> dict[str, torch.Tensor]:
    """The same random micro-batch on every rank, a quarter of its targets ignored."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (2, MAX_LEN), generator=generator)
    labels = torch.randint(0, 1000, (2, MAX_LEN), generator=generator)
    labels[torch.rand(labels.shape, generator=generator) < 0.25] = IGNORE
    return dict(input_ids=ids, labels=labels, position_ids=torch.arange(MAX_LEN).expand(2, -1))


def loss_and_grads(model: torch.nn.Module, mb: dict, chunk: int) -> tuple[float, dict]:
    tokens = (mb["labels"] != IGNORE).sum().float()
    loss = micro_step(model, mb, tokens, True, chunk)
    grads = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def check_chunked_loss(model: torch.nn.Module) -> None:
    mb = batch(0)
    reference, reference_grads = loss_and_grads(model, mb, 0)
    for chunk in (5, MAX_LEN):  # 5: a short last chunk of the 32-position shard; MAX_LEN: one chunk
        loss, grads = loss_and_grads(model, mb, chunk)
        assert abs(loss - reference) <= TOL * abs(reference), (chunk, loss, reference)
        for name, grad in grads.items():
            error = ((grad - reference_grads[name]).abs().max() / reference_grads[name].abs().max()).item()
            assert error <= TOL, (chunk, name, error)
    with torch.no_grad(), loss_context(True):
        eval_reference = summed_loss(model, batch(1)).item()
        eval_chunked = summed_loss(model, batch(1), 7).item()
    assert abs(eval_chunked - eval_reference) <= TOL * abs(eval_reference), (eval_chunked, eval_reference)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--done", type=Path, required=True)
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    model = sharded_model(parity_config(None, dp=2, tp=2), device)
    check_chunked_loss(model)
    dist.barrier()
    if dist.get_rank() == 0:
        args.done.write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
