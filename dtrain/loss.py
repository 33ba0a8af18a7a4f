"""Cross-entropy summed over supervised tokens, on vocabulary-sharded logits when loss parallel is on.

The caller divides by the global supervised-token count (all dp ranks, all micro-batches), so the
loss is a token mean over the whole global batch whatever the mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from dtrain.config import ParallelConfig

# The label of a position that is not a target (prompt, padding, a document's first token):
# cross-entropy's default ignore_index.
IGNORE = -100


class LossSettings(NamedTuple):
    """How the loss is computed on the mesh (parallel.loss_parallel, loss_impl, loss_chunk), in the
    order dtrain.step's functions take them."""

    parallel: bool = True
    impl: str = "dense"
    chunk: int = 0

    @classmethod
    def of(cls, settings: ParallelConfig) -> LossSettings:
        return cls(settings.loss_parallel, settings.loss_impl, settings.loss_chunk)


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Forward loss and backward must both run inside it (loss_parallel's rule)."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses as a plain tensor (a DTensor loss is replicated: take the local value).
    A vocabulary padded for tp (dtrain.parallel.vocab) arrives with its padded columns at -inf, set
    by lm_head's own hook, so this and the chunked path below see only the real vocabulary."""
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss.to_local() if isinstance(loss, DTensor) else loss


@contextlib.contextmanager
def head_detached(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the model's own forward (so FSDP2's root hook unshards embed/norm/lm_head) with lm_head
    replaced by an identity, so the forward returns the final hidden states instead of the logits.
    Yields the real lm_head: FSDP2 keeps the root unsharded after forward, so calling it afterwards
    sees the gathered weights, and its TP (and any mask) hooks apply to every chunk."""
    head = model.lm_head
    model.lm_head = torch.nn.Identity()
    try:
        yield head
    finally:
        model.lm_head = head


def chunk_labels(labels: torch.Tensor, local_len: int, start: int, stop: int) -> torch.Tensor:
    """Labels of the chunk [start, stop) of every rank's sequence shard, in the order lm_head's
    sequence all-gather concatenates them (rank 0's piece, then rank 1's ...). Without sequence
    parallel local_len is the whole sequence and this is a plain slice."""
    batch, seq = labels.shape
    pieces = labels.view(batch, seq // local_len, local_len)[:, :, start:stop]
    return pieces.reshape(batch, -1)


def chunked_summed_cross_entropy(
    head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """summed_cross_entropy(head(hidden), labels) computed `chunk` positions of the local sequence at
    a time. Each chunk is checkpointed, so only one chunk's logits (chunk x vocab / tp per row) are
    alive at once, in forward and in backward. A sequence-parallel hidden DTensor is chunked on its
    local shard (slicing the DTensor would all-gather the whole sequence for every chunk); lm_head's
    input hook gathers one chunk at a time."""
    if isinstance(hidden, DTensor):
        hidden = hidden.to_local()
    local_len = hidden.shape[1]
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    for start in range(0, local_len, chunk):
        stop = min(start + chunk, local_len)
        piece = chunk_labels(labels, local_len, start, stop)
        total = total + checkpoint(_head_loss, head, hidden[:, start:stop], piece, use_reentrant=False)
    return total


def _head_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return summed_cross_entropy(head(hidden), labels)
