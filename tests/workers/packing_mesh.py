"""Launched by tests/test_packing.py by run_worker with 4 processes (gloo): the 2×2 mesh.

Checks, each asserting on every rank (a failure exits non-zero):
- a packed batch gives the loss and gradients of the same documents run one by one (token mean);
- perturbing one document of a packed row leaves the logits of the row's other documents unchanged
  (and, without the restarting positions, it would not);
- the loader gives tp ranks of one dp group the same rows and dp groups different ones;
- data preparation runs on local rank 0 before the others, and an error there reaches every rank.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.checks import check_config
from dtrain.config import ConfigError, TrainConfig
from dtrain.data.formats import load_tokenizer
from dtrain.data.pipeline import build_data, once_per_machine, prepare, to_rows
from dtrain.distributed import build_parallel, init_distributed
from dtrain.loss import IGNORE, loss_context, summed_cross_entropy
from dtrain.model import build_model, load_model_config
from tests.helpers import parity_config

RTOL = 1e-5
MAX_LEN = 64  # room for rows of 3 to 7 documents of the shipped dataset


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def loss_and_grads(model, rows: list[dict], total_tokens: torch.Tensor) -> tuple[float, dict]:
    """Summed token loss / the global token count, backward per row; the all-reduced loss and grads."""
    loss_sum = torch.zeros(())
    for row in rows:
        batch = {k: v[None] for k, v in row.items()}
        with loss_context(True):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = summed_cross_entropy(logits, batch["labels"])
            (loss / total_tokens).backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)  # over the world: tp peers hold equal copies, so divide by tp below
    grads = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss_sum.item() / 2 / total_tokens.item(), grads


def check_packing_exactness(model, rows, dp_rank: int) -> None:
    """dp rank r gets packed row r (of 2); one by one, it runs the documents of that row alone, each
    right-padded in its own row. Empty rows even out the count of forwards (FSDP needs the same on
    every dp rank); they have no targets."""
    packed_row = rows[dp_rank]
    documents = rows.rows[dp_rank]
    singles = [rows.build([doc]) for doc in documents]
    most = max(len(rows.rows[0]), len(rows.rows[1]))
    singles += [rows.build([])] * (most - len(singles))
    tokens = (packed_row["labels"] != IGNORE).sum().float()
    assert tokens == sum((row["labels"] != IGNORE).sum() for row in singles)
    dist.all_reduce(tokens)
    tokens /= 2  # the tp peers counted the same row
    packed_loss, packed_grads = loss_and_grads(model, [packed_row], tokens)
    single_loss, single_grads = loss_and_grads(model, singles, tokens)
    assert abs(packed_loss - single_loss) <= RTOL * abs(single_loss), (packed_loss, single_loss)
    for name, grad in single_grads.items():
        assert relative_error(packed_grads[name], grad) < RTOL, name


@torch.no_grad()
def check_no_cross_document_attention(model, rows) -> None:
    """Change every token of the middle document of a 3-document row: the other two documents'
    logits stay the same; with plain positions (no restarts) the last one's would change."""
    index = next(i for i, docs in enumerate(rows.rows) if len(docs) >= 3)
    row = rows[index]
    lengths = [len(rows.examples[doc]["input_ids"]) for doc in rows.rows[index]]
    middle = slice(lengths[0], lengths[0] + lengths[1])
    others = torch.ones(MAX_LEN, dtype=torch.bool)
    others[middle] = False
    others[sum(lengths) :] = False  # padding
    perturbed = row["input_ids"].clone()
    perturbed[middle] = (perturbed[middle] + 7) % 500 + 10

    def logits(ids, positions):
        return full(model(input_ids=ids[None], position_ids=positions[None]).logits)[0]

    before, after = logits(row["input_ids"], row["position_ids"]), logits(perturbed, row["position_ids"])
    assert (before[others] - after[others]).abs().max() < 1e-6
    assert (before[middle] - after[middle]).abs().max() > 1e-3  # the perturbation does something
    plain = torch.arange(MAX_LEN)
    leak = (logits(row["input_ids"], plain) - logits(perturbed, plain))[sum(lengths[:2]) : sum(lengths)]
    assert leak.abs().max() > 1e-3  # without restarts the last document sees the middle one


def check_tp_ranks_share_rows(config, tokenizer, parallel) -> None:
    train = TrainConfig(global_batch_size=8, micro_batch_size=2, seed=3)
    loader = build_data(config.data, train, tokenizer, parallel.dp_rank, parallel.dp_size).train
    for _ in range(3):
        mine = torch.cat([mb["input_ids"] for mb in loader.next_step()])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        coordinate = parallel.mesh.get_coordinate()  # (dp, tp)
        for rank, theirs in enumerate(every):
            same_dp = parallel.mesh.mesh[coordinate[0]].tolist()
            assert torch.equal(theirs, mine) == (rank in same_dp), (rank, same_dp)


def check_once_per_machine(log_file: Path) -> None:
    rank = dist.get_rank()

    def prepare_fn() -> int:
        with log_file.open("a") as log:  # short appends: one line each, whole
            log.write(f"start {rank}\n")
            log.flush()
            time.sleep(0.2)
            log.write(f"end {rank}\n")
        return rank

    assert once_per_machine(prepare_fn) == rank
    dist.barrier()
    lines = log_file.read_text().split()
    events = [" ".join(lines[i : i + 2]) for i in range(0, len(lines), 2)]
    assert events[:2] == ["start 0", "end 0"], events  # the others read what rank 0 cached

    def fails_on_rank0() -> None:
        if rank == 0:
            raise ConfigError("data.path='x': broken")

    try:
        once_per_machine(fails_on_rank0)
    except ConfigError as error:
        assert str(error) == "data.path='x': broken"
    else:
        raise AssertionError(f"rank {rank} did not get rank 0's error")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--done", type=Path, required=True)
    args = parser.parse_args()
    device = init_distributed(timeout_s=300)
    config = parity_config(None, dp=2, tp=2)
    config.data.packing = True
    config.data.max_len = MAX_LEN
    config.train.precision = "fp32"
    model_config = load_model_config(config.model)
    shape = check_config(config, dist.get_world_size(), model_config)
    parallel = build_parallel(shape, device)
    model = build_model(model_config, config, parallel, device)

    tokenizer = load_tokenizer(config.model.tokenizer)
    examples, _ = prepare(config.data, tokenizer, seed=0)
    rows = to_rows(examples, config.data, tokenizer)
    assert len(rows.rows[0]) >= 2 and len(rows.rows[1]) >= 2, rows.rows[:2]

    check_packing_exactness(model, rows, parallel.dp_rank)
    check_no_cross_document_attention(model, rows)
    check_tp_ranks_share_rows(config, tokenizer, parallel)
    check_once_per_machine(args.done.with_name("prepare.log"))
    dist.barrier()
    if dist.get_rank() == 0:
        args.done.write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
