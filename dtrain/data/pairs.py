"""Preference pairs → micro-batches (dtrain.dpo): the rows stage of the preference format.

The stream is of pairs: train.global_batch_size and train.micro_batch_size count pairs, and step k
takes pairs [k·G, (k+1)·G) of the seeded stream (dtrain/data/loader.py), whatever the mesh. A
micro-batch of m pairs is built whole on one rank (pair-atomic): its 2·m sequences, prompt +
chosen and prompt + rejected of each pair, one per row of data.max_len slots, or (data.packing)
best-fit packed into as few rows as hold them, position ids restarting per sequence, so the document
mask keeps them apart. Packing never crosses a micro-batch, hence never an optimizer step.

Besides the rows (input_ids, labels, position_ids, num_tokens: dtrain/data/packing.py's), a
micro-batch holds `sequence_index` [rows, max_len]: at each target position, the sequence it scores
(2·i for pair i's chosen, 2·i + 1 for its rejected; -1 elsewhere); `completion_tokens` [2·m]: each
sequence's completion length (TRL's completion mask); `pair_index` [m]: each pair's index in the
tokenized dataset (the reference log-probs table's row).
"""

from __future__ import annotations

from typing import Any

import datasets
import torch
from torch.utils.data import Dataset

from dtrain.data.packing import build_row, pack

NO_SEQUENCE = -1
Document = tuple[list[int], list[int]]  # (input_ids, mask)


class Pairs(Dataset):
    """Pair i of the tokenized dataset: its prompt, chosen and rejected token ids and its index."""

    def __init__(self, examples: datasets.Dataset, max_len: int, pad_id: int, packing: bool) -> None:
        self.examples = examples.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
        self.max_len, self.pad_id, self.packing = max_len, pad_id, packing

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.examples[index], "index": index}

    def collate(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pair_batch(pairs, self.max_len, self.pad_id, self.packing)


def pair_sequences(pair: dict[str, Any]) -> list[Document]:
    """The pair's two sequences as (input_ids, mask) documents: the mask is 1 on the completion."""
    prompt = list(pair["prompt_ids"])
    return [
        (prompt + list(pair[side]), [0] * len(prompt) + [1] * len(pair[side]))
        for side in ("chosen_ids", "rejected_ids")
    ]


def pair_batch(
    pairs: list[dict[str, Any]], max_len: int, pad_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch of `pairs` (see the module's docstring); no pairs: one row of padding."""
    documents = [document for pair in pairs for document in pair_sequences(pair)]
    if packing:
        layout = pack([len(ids) for ids, _ in documents], max_len)
    else:
        layout = [[index] for index in range(len(documents))]
    rows = [build_row([documents[i] for i in row], max_len, pad_id) for row in layout or [[]]]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["sequence_index"] = torch.stack([sequence_index(row, documents, max_len) for row in layout or [[]]])
    batch["completion_tokens"] = torch.tensor([sum(mask) for _, mask in documents], dtype=torch.long)
    batch["pair_index"] = torch.tensor([pair["index"] for pair in pairs], dtype=torch.long)
    return batch


def sequence_index(
    row: list[int], documents: list[tuple[list[int], list[int]]], max_len: int
) -> torch.Tensor:
    """[max_len]: the sequence each target position of the row scores (build_row's labels: position t
    predicts token t + 1 of its document where that token is a completion token), else NO_SEQUENCE."""
    index = torch.full((max_len,), NO_SEQUENCE, dtype=torch.long)
    start = 0
    for sequence in row:
        ids, mask = documents[sequence]
        targets = torch.tensor(mask[1:], dtype=torch.bool)
        index[start : start + len(ids) - 1][targets] = sequence
        start += len(ids)
    return index


def eval_pair_batches(pairs: Pairs, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[dict]:
    """Every eval pair once, split over dp ranks in contiguous shares of micro-batches of
    `micro_batch_size` pairs; a rank short of pairs gets micro-batches with fewer or none (one row of
    padding), so that every rank runs the same number of forwards (FSDP's collectives need it)."""
    per_step = micro_batch_size * dp_size
    per_rank = -(-len(pairs) // per_step) * micro_batch_size
    start = dp_rank * per_rank
    mine = [pairs[i] for i in range(start, min(start + per_rank, len(pairs)))]
    return [pairs.collate(mine[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
