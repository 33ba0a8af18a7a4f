"""Tensor-parallel plan for Hugging Face `Qwen3ForCausalLM`: Llama's table plus the per-head q/k
norms, which run on the local heads of the colwise q/k projections with a replicated weight."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.parallel import llama
from dtrain.parallel.styles import HeadShardedNorm

model_plan = llama.model_plan


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one `Qwen3DecoderLayer`."""
    return llama.layer_plan(sequence_parallel) | {
        "self_attn.q_norm": HeadShardedNorm(),
        "self_attn.k_norm": HeadShardedNorm(),
    }
