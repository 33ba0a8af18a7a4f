"""Rows → each dp rank's micro-batches, through torchdata's `StatefulDataLoader`.

The order is one global stream of rows that does not depend on the mesh: epoch e is a permutation
of the rows seeded by (seed, e), the epochs follow each other, and optimizer step s uses stream rows
[s·G, (s+1)·G) (G = global batch), micro-step k of it rows [s·G + k·M, s·G + (k+1)·M) (M = micro
batch × dp, the global micro-batch), and dp rank r micro-batch k's slice [.. + r·m, .. + (r+1)·m)
(m = micro batch): which rows a micro-step holds does not depend on the mesh for a given M (the
mixture-of-experts aux loss of `moe.aux_scope=micro_step` is over them). tp and cp ranks of one dp
group get the same rows. The loader's state is where the stream stands (epoch,
position), so a run resumed on any dp size continues the same stream. StatefulDataLoader's own
state is not saved: it counts this rank's batches, which is mesh-dependent.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset, Sampler, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from dtrain.config import ConfigError
from dtrain.data.packing import build_row

STATE_VERSION = 1


class Rows(Dataset):
    """Row i: the examples rows[i] of the tokenized dataset, built into one max_len row."""

    def __init__(self, examples: datasets.Dataset, rows: list[list[int]], max_len: int, pad_id: int) -> None:
        self.examples = examples.select_columns(["input_ids", "mask"])
        self.rows = rows
        self.max_len = max_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.build(self.rows[index])

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return default_collate(rows)

    def build(self, examples: list[int]) -> dict[str, torch.Tensor]:
        picked = self.examples[examples] if examples else {"input_ids": [], "mask": []}
        return build_row(
            list(zip(picked["input_ids"], picked["mask"], strict=True)), self.max_len, self.pad_id
        )


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_rows))
    generator = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


class StreamSampler(Sampler[int]):
    """This dp rank's rows of the global stream, from global position `start` on, forever: of each
    global micro-batch (micro_batch × dp_size consecutive stream rows) its `micro_batch` rows."""

    def __init__(
        self,
        num_rows: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        start: int,
    ) -> None:
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.micro_batch, self.global_micro_batch = micro_batch, micro_batch * dp_size
        self.offset = start + dp_rank * micro_batch
        self._epoch, self._order = -1, []

    def row(self, position: int) -> int:
        epoch, index = divmod(position, self.num_rows)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_rows, self.seed, epoch, self.shuffle)
        return self._order[index]

    def __iter__(self) -> Iterator[int]:
        start = self.offset
        while True:  # a step is a whole number of global micro-batches (checks.check_config)
            for i in range(self.micro_batch):
                yield self.row(start + i)
            start += self.global_micro_batch


class SFTLoader:
    """The micro-batches of each optimizer step for one dp rank. `state_dict()` is mesh-independent:
    {"version", "epoch", "position" (rows of that epoch already used by all ranks together),
    "rows_per_epoch", "seed", "shuffle"}.

    On CUDA (the defaults of pin_memory and prefetch) the rows come in pinned memory, so the
    trainer's `.to(device, non_blocking=True)` is a real asynchronous copy, and a background thread
    builds the next step's micro-batches while this step runs. Prefetching never changes the
    stream: the state counts the steps handed out, not the ones built ahead."""

    def __init__(
        self,
        rows: Rows | Any,  # Rows, or dtrain.data.pairs.Pairs: a dataset with a `collate`
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch: bool | None = None,
    ) -> None:
        self.rows = rows
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.num_workers = seed, shuffle, num_workers
        self.accumulation = global_batch_size // (micro_batch_size * dp_size)
        self.consumed = 0  # global stream position: rows handed out to all dp ranks together
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.prefetch = self.pin_memory if prefetch is None else prefetch
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-prefetch") if self.prefetch else None
        )
        self._ahead: Future | None = None  # the next step's micro-batches, being built

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self.rows)

    def restarted(self) -> SFTLoader:
        """The same stream from its start, built as it is read (dtrain.dpo's reference pass)."""
        return SFTLoader(
            self.rows,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=self.seed,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch=False,
        )

    @property
    def epoch(self) -> int:
        return self.consumed // len(self.rows)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next optimizer step (an error building them is raised
        here, by the step that needs them)."""
        ahead, self._ahead = self._ahead, None
        micro_batches = ahead.result() if ahead is not None else self._build_step()
        self.consumed += self.global_batch_size
        if self._pool is not None:
            self._ahead = self._pool.submit(self._build_step)
        return micro_batches

    def _build_step(self) -> list[dict[str, torch.Tensor]]:
        if self._iterator is None:
            sampler = StreamSampler(
                len(self.rows), self.micro_batch_size, self.dp_rank, self.dp_size,
                self.seed, self.shuffle, start=self.consumed,
            )  # fmt: skip
            with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API on every start
                warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
                loader = StatefulDataLoader(
                    self.rows,
                    batch_size=self.micro_batch_size,
                    sampler=sampler,
                    collate_fn=self.rows.collate,
                    num_workers=self.num_workers,
                    pin_memory=self.pin_memory,
                )
                self._iterator = iter(loader)
        return [next(self._iterator) for _ in range(self.accumulation)]

    def _drop_ahead(self) -> None:
        """Forget the step built ahead (waiting for its thread, which uses the iterator)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.exception()  # wait; an error there belongs to a step that will be rebuilt

    def state_dict(self) -> dict[str, Any]:
        epoch, position = divmod(self.consumed, len(self.rows))
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "rows_per_epoch": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream where `state` left it (saved on any mesh)."""
        mine = self.state_dict()
        for key in ("version", "rows_per_epoch", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"data loader state: {key}={state.get(key)!r} in the checkpoint, {mine[key]!r} now; "
                    "the data, packing, train.seed or data.shuffle changed since it was saved"
                )
        self._drop_ahead()
        self.consumed = state["epoch"] * len(self.rows) + state["position"]
        self._iterator = None


def eval_micro_batches(rows: Rows, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[dict]:
    """Every eval row once, split over dp ranks; padded with empty rows (no targets) so that every
    rank runs the same number of forwards (FSDP's collectives need it)."""
    per_step = micro_batch_size * dp_size
    count = -(-len(rows) // per_step) * per_step
    per_rank = count // dp_size
    mine = [
        rows[i] if i < len(rows) else rows.build([])
        for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ]
    return [default_collate(mine[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
