"""Tensor-parallel plans of the mixture-of-experts families: each is its dense relative's attention
table (Qwen3-MoE: Qwen3's, per-head q/k norms; Mixtral: Llama's; OLMoE: Llama's with OLMo 2's
whole-width q/k norms) with the sparse block's styles in place of the MLP's
(dtrain/parallel/experts.py: each tp rank routes its sequence-parallel tokens, the router and the
experts replicated over tp). Layers without experts (`mlp_only_layers`, `decoder_sparse_step`) are
refused at tp > 1 by the checks."""

from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.parallel import llama, qwen3
from dtrain.parallel.experts import sparse_layer_plan
from dtrain.parallel.styles import WidthShardedNorm


def _olmoe_dense_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    width_norms = {"self_attn.q_norm": WidthShardedNorm(), "self_attn.k_norm": WidthShardedNorm()}
    return llama.layer_plan(sequence_parallel) | width_norms


QWEN3_MOE = SimpleNamespace(model_plan=qwen3.model_plan, layer_plan=sparse_layer_plan(qwen3.layer_plan))
MIXTRAL = SimpleNamespace(model_plan=llama.model_plan, layer_plan=sparse_layer_plan(llama.layer_plan))
OLMOE = SimpleNamespace(model_plan=llama.model_plan, layer_plan=sparse_layer_plan(_olmoe_dense_plan))
