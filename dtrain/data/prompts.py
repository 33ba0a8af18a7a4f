"""Prompts → generations → micro-batches of completions (dtrain.grpo): the rows stage of the prompt format.

The stream is of prompts: one step of it is one generation's prompts, train.global_batch_size ×
grpo.steps_per_generation / grpo.num_generations of them, the same on every rank (dtrain.data.loader's
seeded stream with one reader: `Prompts.stream_shape`), whatever the mesh. The objective
(dtrain.objectives.grpo) samples their completions, scores them, and cuts the generation into its
optimizer steps; `rollout_batch` then builds one micro-batch of completions: each sequence (prompt +
completion) whole in a row of data.max_len slots, one per row or (data.packing) best-fit packed, position
ids restarting per sequence so that the document mask keeps them apart; never across a micro-batch.

Besides the rows (input_ids, labels, position_ids, num_tokens: dtrain/data/packing.py's), a micro-batch
holds per sequence `prompt_tokens`, `completion_tokens` (its trained tokens: 0 for a completion left out
of the loss), `advantages` and `token_offset` (where its tokens start in the flat per-token tensors:
`old_logps`, `ref_logps`, `is_ratio`, present when the loss needs them); and `sequence_index`
[rows, max_len]: at each target position, the sequence it scores, else -1. A completion token's place
in its sequence follows from its position id (`token_place`), which context parallel splits with the
rows, so the flat tensors stay whole on every rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset

from dtrain.config import ConfigError
from dtrain.data.packing import build_row, pack
from dtrain.data.pairs import sequence_index

TOKEN_KEYS = ("old_logps", "ref_logps", "is_ratio")  # the flat per-token tensors a micro-batch may hold


class Prompts(Dataset):
    """Prompt i of the tokenized dataset: its token ids, its record (the data's columns) and its index."""

    def __init__(self, examples: datasets.Dataset) -> None:
        self.examples = examples.select_columns(["prompt_ids", "record", "length"])

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = self.examples[index]
        return {"ids": list(example["prompt_ids"]), "record": json.loads(example["record"]), "index": index}

    def collate(self, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return prompts

    def check_room(self, max_len: int, max_completion_length: int, where: str) -> None:
        """Every prompt leaves room for a whole completion in a row (TRL never truncates a prompt)."""
        lengths = self.examples["length"][:]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[longest] + max_completion_length > max_len:
            raise ConfigError(
                f"{where} example {longest}: its prompt of {lengths[longest]} tokens and "
                f"grpo.max_completion_length={max_completion_length} do not fit data.max_len={max_len} "
                f"(a prompt is never truncated; raise data.max_len to at least "
                f"{lengths[longest] + max_completion_length})"
            )


@dataclass
class Rollout:
    """One completion of a step, as the loss takes it."""

    prompt_ids: list[int]
    ids: list[int]  # the completion's ids, its EOS included when it has one
    advantage: float
    trained: bool = True  # False: left out of the loss (grpo.mask_truncated_completions)
    tokens: dict[str, list[float]] | None = None  # per completion token: old_logps, ref_logps, is_ratio


def rollout_batch(
    rollouts: list[Rollout], max_len: int, pad_id: int, packing: bool
) -> dict[str, torch.Tensor]:
    """A micro-batch of `rollouts` (the module's docstring); none: one row of padding. A completion left
    out of the loss keeps its prompt in the row (what the MoE aux loss counts, as TRL's attention mask)."""
    documents = [
        (r.prompt_ids + r.ids, [0] * len(r.prompt_ids) + [1] * len(r.ids))
        if r.trained
        else (r.prompt_ids, [0] * len(r.prompt_ids))
        for r in rollouts
    ]
    if any(len(ids) > max_len for ids, _ in documents):
        raise ValueError(f"a sequence of more than data.max_len={max_len} tokens")
    layout = (
        pack([len(ids) for ids, _ in documents], max_len) if packing else [[i] for i in range(len(documents))]
    )
    rows = [build_row([documents[i] for i in row], max_len, pad_id) for row in layout or [[]]]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["sequence_index"] = torch.stack([sequence_index(row, documents, max_len) for row in layout or [[]]])
    completion = [len(r.ids) if r.trained else 0 for r in rollouts]
    batch["prompt_tokens"] = torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.long)
    batch["completion_tokens"] = torch.tensor(completion, dtype=torch.long)
    batch["advantages"] = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)
    offsets = torch.tensor([0, *completion], dtype=torch.long).cumsum(0)
    batch["token_offset"] = offsets[:-1]
    for key in TOKEN_KEYS:
        if rollouts and rollouts[0].tokens and key in rollouts[0].tokens:
            values = [v for r, n in zip(rollouts, completion, strict=True) for v in r.tokens[key][:n]]
            batch[key] = torch.tensor(values, dtype=torch.float32)
    return batch


def token_place(micro_batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position of this rank's part of the rows ([rows, local]): whether it scores a completion
    token, the sequence it scores (0 where it scores none) and that token's index in the flat per-token
    tensors (0 where none). Position p of a sequence with a P-token prompt predicts its token p + 1,
    completion token p + 1 - P."""
    index = micro_batch["sequence_index"]
    scored = index >= 0
    sequence = index.clamp(min=0)
    place = micro_batch["position_ids"] + 1 - micro_batch["prompt_tokens"][sequence]
    flat = torch.where(scored, micro_batch["token_offset"][sequence] + place, 0)
    return scored, sequence, flat
