"""Prompts with completions → micro-batches (dtrain.distill): the rows stage of the prompt_completion
format.

The stream is of examples (a prompt and its completion): train.global_batch_size and
train.micro_batch_size count them, and step k takes examples [k·G, (k+1)·G) of the seeded stream
(dtrain/data/loader.py), whatever the mesh. A micro-batch of m examples is built whole on one rank by
dtrain.grpo's row builder (dtrain/data/prompts.py, `rollout_batch`): each example one sequence, prompt
+ completion, its completion tokens the loss's targets (each predicted from the position before it:
the first one from the prompt's last position), one per row of data.max_len slots or (data.packing)
best-fit packed into as few rows as hold them, position ids restarting per sequence, so the document
mask keeps them apart; never across a micro-batch. An on-policy step rebuilds its micro-batches from
the same examples' prompts and the sampled completions (`completion_batch` again).

Besides that builder's tensors, a micro-batch holds `example_index` [m]: each example's index in the
tokenized dataset (its prompt).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset

from dtrain.data.prompts import Rollout, rollout_batch


class Completions(Dataset):
    """Example i of the tokenized dataset: its prompt and completion token ids and its index."""

    def __init__(self, examples: datasets.Dataset, max_len: int, pad_id: int, packing: bool) -> None:
        self.examples = examples.select_columns(["prompt_ids", "completion_ids", "prompt"])
        self.max_len, self.pad_id, self.packing = max_len, pad_id, packing

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = self.examples[index]
        return {
            "prompt_ids": example["prompt_ids"],
            "completion_ids": example["completion_ids"],
            "index": index,
        }

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.batch(
            [example["index"] for example in examples], [example["completion_ids"] for example in examples]
        )

    def batch(self, indices: Sequence[int], completions: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """A micro-batch of examples `indices`, each prompt followed by its completion in `completions`
        (the data's, or sampled ones)."""
        prompts = [self.examples[index]["prompt_ids"] for index in indices]
        return completion_batch(prompts, completions, indices, self.max_len, self.pad_id, self.packing)

    def prompt(self, index: int) -> tuple[list[int], Any]:
        """Example `index`'s prompt: its token ids, and as the record gives it (a string or messages)."""
        example = self.examples[index]
        return list(example["prompt_ids"]), json.loads(example["prompt"])


def completion_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    indices: Sequence[int],
    max_len: int,
    pad_id: int,
    packing: bool,
) -> dict[str, torch.Tensor]:
    """A micro-batch of the sequences prompt + completion, the completion's tokens scored (see the
    module's docstring); no examples: one row of padding."""
    rollouts = [
        Rollout(prompt_ids=list(prompt), ids=list(completion), advantage=0.0)
        for prompt, completion in zip(prompts, completions, strict=True)
    ]
    batch = rollout_batch(rollouts, max_len, pad_id, packing)
    batch["example_index"] = torch.tensor(list(indices), dtype=torch.long)
    return batch
