"""Prompts with completions → micro-batches (dtrain.distill): the rows stage of the prompt_completion
format.

The stream is of examples (a prompt and its completion): train.global_batch_size and
train.micro_batch_size count them, and step k takes examples [k·G, (k+1)·G) of the seeded stream
(dtrain/data/loader.py), whatever the mesh. A micro-batch of m examples is built whole on one rank:
each example one sequence, prompt + completion, its completion tokens the loss's targets (each
predicted from the position before it: the first one from the prompt's last position), one per row
of data.max_len slots or (data.packing) best-fit packed into as few rows as hold them, position ids
restarting per sequence, so the document mask keeps them apart. Packing never crosses a micro-batch,
hence never an optimizer step; an on-policy step rebuilds its micro-batches from the same examples'
prompts and the sampled completions (`completion_batch`).

Besides the rows (input_ids, labels, position_ids, num_tokens: dtrain/data/packing.py's), a
micro-batch holds `example_index` [m]: each example's index in the tokenized dataset (its prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset

from dtrain.data.packing import build_row, pack


class Completions(Dataset):
    """Example i of the tokenized dataset: its prompt and completion token ids and its index."""

    def __init__(self, examples: datasets.Dataset, max_len: int, pad_id: int, packing: bool) -> None:
        self.examples = examples.select_columns(["prompt_ids", "completion_ids"])
        self.max_len, self.pad_id, self.packing = max_len, pad_id, packing

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.examples[index], "index": index}

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return completion_batch(
            [example["prompt_ids"] for example in examples],
            [example["completion_ids"] for example in examples],
            [example["index"] for example in examples],
            self.max_len,
            self.pad_id,
            self.packing,
        )

    def prompt(self, index: int) -> list[int]:
        """Example `index`'s prompt ids."""
        return list(self.examples[index]["prompt_ids"])


def completion_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    indices: Sequence[int],
    max_len: int,
    pad_id: int,
    packing: bool,
) -> dict[str, torch.Tensor]:
    """A micro-batch of the sequences prompt + completion, the completion's tokens scored (see the
    module's docstring); no examples: one row of padding. A sequence longer than max_len loses its
    completion's end."""
    documents = [
        (list(prompt) + list(completion), [0] * len(prompt) + [1] * len(completion))
        for prompt, completion in zip(prompts, completions, strict=True)
    ]
    documents = [(ids[:max_len], mask[:max_len]) for ids, mask in documents]
    if packing:
        layout = pack([len(ids) for ids, _ in documents], max_len)
    else:
        layout = [[index] for index in range(len(documents))]
    rows = [build_row([documents[i] for i in row], max_len, pad_id) for row in layout or [[]]]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["example_index"] = torch.tensor(list(indices), dtype=torch.long)
    return batch
