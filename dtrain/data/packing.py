"""Rows of max_len token slots: one example each, or (data.packing) several packed together.

A row's labels are pre-shifted (labels[t] is the target at t, -100 ignored). A packed row restarts
`position_ids` at 0 for every document; dtrain's attention turns the restarts into a block-diagonal
causal mask, so no token attends across documents. Each document's last position has no target
(HF's unshifted convention says the same by putting -100 on every document's first label), so no
document learns to predict the next one's first token. Padding continues the last document's
positions: it restarts nothing, and an unpacked row stays one plain causal sequence.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import torch

from dtrain.loss import IGNORE


def pack(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Best-fit decreasing, deterministic: longest example first (ties by index), each into the
    open row with the least room that still holds it, else a new row. Returns example indices per row."""
    rows: list[list[int]] = []
    open_rows: dict[int, list[int]] = {}  # room left → rows with exactly that room
    rooms: list[int] = []  # the keys of open_rows, sorted (at most max_len of them)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > max_len:
            raise ValueError(f"example {index} has {length} tokens > max_len {max_len}")
        k = bisect_left(rooms, length)
        if k == len(rooms):
            row, room = len(rows), max_len
            rows.append([])
        else:
            room = rooms[k]
            row = open_rows[room].pop()
            if not open_rows[room]:
                del open_rows[room]
                rooms.pop(k)
        rows[row].append(index)
        left = room - length
        if left > 0:
            if left not in open_rows:
                open_rows[left] = []
                insort(rooms, left)
            open_rows[left].append(row)
    return rows


def one_per_row(count: int) -> list[list[int]]:
    return [[i] for i in range(count)]


def efficiency(lengths: Sequence[int], rows: list[list[int]], max_len: int) -> float:
    """Non-pad tokens / token slots."""
    return sum(lengths) / max(1, len(rows) * max_len)


def build_row(
    documents: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """One row from (input_ids, mask) documents; also `num_tokens`, its non-pad slots."""
    input_ids = torch.full((max_len,), pad_id, dtype=torch.long)
    labels = torch.full((max_len,), IGNORE, dtype=torch.long)
    position_ids = torch.zeros(max_len, dtype=torch.long)
    start = 0
    for ids, mask in documents:
        n = len(ids)
        if start + n > max_len:
            raise ValueError(f"documents of {start + n} tokens do not fit a row of {max_len}")
        tokens = torch.tensor(ids, dtype=torch.long)
        input_ids[start : start + n] = tokens
        supervised = torch.tensor(mask[1:], dtype=torch.bool)
        labels[start : start + n - 1] = torch.where(supervised, tokens[1:], IGNORE)
        position_ids[start : start + n] = torch.arange(n)
        start += n
    last_start = start - len(documents[-1][0]) if documents else 0
    position_ids[start:] = torch.arange(start - last_start, max_len - last_start)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "num_tokens": torch.tensor(start),
    }
