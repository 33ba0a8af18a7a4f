"""Cross-entropy summed over supervised tokens, on vocabulary-sharded logits when loss parallel is on.

The caller divides by the global supervised-token count (all dp ranks, all micro-batches), so the
loss is a token mean over the whole global batch whatever the mesh.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from dtrain.data import IGNORE


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Forward loss and backward must both run inside it (loss_parallel's rule)."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses as a plain tensor (a DTensor loss is replicated: take the local value)."""
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss.to_local() if isinstance(loss, DTensor) else loss
