"""Context parallel: every row's sequence split over the cp ranks, K and V gathered in attention.

Each row is cut into 2·cp equal chunks and cp rank i keeps chunks i and 2·cp-1-i: an early and a
late one, so every rank does the same causal work (Llama 3's long-context recipe). A rank embeds
and runs only its own tokens through every layer; in attention its queries meet the keys and values
of the whole row, all-gathered over cp (autograd-aware: the backward reduce-scatters their
gradients to the ranks that own them), under the causal and document mask of the tokens' global
indices. Rotary embeddings get the global `position_ids` of the local tokens, so the model computes
exactly what it computes on the whole row.

torch's own `context_parallel` (ring attention) dispatches only the CUDA SDPA kernels and takes no
document mask, which packed rows need; this path runs on every device and takes any mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh

# The micro-batch key and model forward kwarg that carries a ContextShard: HF passes unknown forward
# kwargs down to every layer's attention function.
CONTEXT_KWARG = "dtrain_context"
# A micro-batch's tensors over the sequence ([rows, seq]), split over cp; the others are per row or
# per sequence and stay whole (dtrain.dpo's `sequence_index` is per position: dtrain/data/pairs.py,
# and so is its LD-DPO `tail`: dtrain.objectives.dpo_loss.with_tail; `filled`:
# dtrain.step.with_filled_slots).
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "filled", "sequence_index", "tail")


def local_token_indices(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """[seq_len / cp]: the global indices of cp rank `rank`'s tokens, chunks rank and 2·cp-1-rank."""
    chunk = seq_len // (2 * cp)
    early = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    late = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([early, late])


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq]: which document of its row each position belongs to (one starts at every 0)."""
    return (position_ids == 0).cumsum(dim=-1)


class ContextShard:
    """What attention needs to see a whole row from one cp rank's tokens. A plain class, not a
    dataclass: FSDP2 copies dataclasses among a layer's inputs field by field, which would hand every
    layer an empty mask cache (and every layer would build and keep its own mask)."""

    def __init__(
        self,
        mesh: DeviceMesh,  # the cp ranks of this (dp, tp) coordinate
        query_index: torch.Tensor,  # [local]: the global index of each local token
        documents: torch.Tensor,  # [batch, seq]: the document of every token of the row
        gather_order: torch.Tensor,  # [seq]: where each global index sits in the rank-order all-gather
    ) -> None:
        self.mesh = mesh
        self.query_index = query_index
        self.documents = documents
        self.gather_order = gather_order
        self.masks: dict[tuple[str, int | None], Any] = {}  # built once, shared by every layer

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, local, dim] on each rank → [batch, heads, seq, dim], in global order."""
        gathered = all_gather_single_autograd(x.movedim(2, 0).contiguous(), 0, self.mesh.get_group())
        return gathered.index_select(0, self.gather_order).movedim(0, 2)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """[batch, 1, local, seq] boolean (True: may attend): causal within each document, and within
        `window` positions when the layer has a sliding window. Built once, shared by every layer."""
        if ("dense", window) not in self.masks:
            self.masks["dense", window] = self._dense_mask(window)
        return self.masks["dense", window]

    def _dense_mask(self, window: int | None) -> torch.Tensor:
        seq = self.documents.shape[1]
        keys = torch.arange(seq, device=self.documents.device)
        queries = self.query_index[:, None]
        allowed = keys[None, :] <= queries
        if window is not None:
            allowed &= queries - keys[None, :] < window
        same = self.documents[:, self.query_index, None] == self.documents[:, None, :]
        return (same & allowed)[:, None]

    def block_mask(self, window: int | None = None) -> Any:
        """flex attention's BlockMask of the same function: the local queries against the whole row."""
        if ("flex", window) not in self.masks:
            self.masks["flex", window] = self._block_mask(window)
        return self.masks["flex", window]

    def _block_mask(self, window: int | None) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        documents, query_index = self.documents, self.query_index

        def visible(b, h, q_idx, kv_idx):
            q = query_index[q_idx]
            ok = (documents[b, q] == documents[b, kv_idx]) & (q >= kv_idx)
            return ok & (q - kv_idx < window) if window is not None else ok

        batch, seq = documents.shape
        return create_block_mask(visible, batch, None, len(query_index), seq, device=documents.device)


def shard_sequence(micro_batch: dict[str, Any], cp_mesh: DeviceMesh) -> dict[str, Any]:
    """This cp rank's part of a micro-batch (unchanged when cp = 1): its tokens of every row (their
    `filled` flags too), its share of the non-pad slots (`num_tokens`), the ContextShard its
    attention needs, and the micro-batch's other tensors as they are."""
    cp = cp_mesh.size()
    if cp == 1:
        return micro_batch
    position_ids = micro_batch["position_ids"]
    seq, device = position_ids.shape[1], position_ids.device
    index = local_token_indices(seq, cp, cp_mesh.get_local_rank(), device)
    rank_order = torch.cat([local_token_indices(seq, cp, rank, device) for rank in range(cp)])
    shard = {
        key: value.index_select(1, index) if key in SEQUENCE_KEYS else value
        for key, value in micro_batch.items()
    }
    shard["num_tokens"] = (index[None, :] < micro_batch["num_tokens"][:, None]).sum(dim=1)
    shard[CONTEXT_KWARG] = ContextShard(
        mesh=cp_mesh,
        query_index=index,
        documents=document_ids(position_ids),
        gather_order=torch.argsort(rank_order),
    )
    return shard
