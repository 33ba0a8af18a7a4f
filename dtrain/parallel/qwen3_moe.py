"""Tensor-parallel plan for Hugging Face `Qwen3MoeForCausalLM`: Qwen3's attention and norms (Llama's
table with per-head q/k norms); each sparse MoE block works on its tp rank's sequence-parallel tokens
with the router and experts replicated over tp (dtrain/parallel/experts.py). Layers without experts
(`mlp_only_layers`, `decoder_sparse_step`) would take Llama's MLP styles: not planned yet."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.parallel import qwen3
from dtrain.parallel.experts import SequenceShardedBlock, TokenShardedRouter

model_plan = qwen3.model_plan


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one `Qwen3MoeDecoderLayer` with a sparse block (checks refuse tp > 1 without
    sequence parallel: the block routes this rank's part of the sequence)."""
    dense = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp")
    plan = {key: style for key, style in qwen3.layer_plan(sequence_parallel).items() if key not in dense}
    return plan | {"mlp": SequenceShardedBlock(), "mlp.gate": TokenShardedRouter()}
