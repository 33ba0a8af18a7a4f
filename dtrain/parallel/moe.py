"""Tensor-parallel plans of the mixture-of-experts families: each is its dense relative's attention
table (Qwen3-MoE: Qwen3's, per-head q/k norms; Mixtral: Llama's; OLMoE: Llama's with OLMo 2's
whole-width q/k norms; GPT-OSS: Llama's, its q/k/v/o biases sharded with their weights, and its
per-head attention sinks split over tp as the q heads are) with the sparse block's styles in place
of the MLP's
(dtrain/parallel/experts.py: each tp rank routes its sequence-parallel tokens, the router and the
experts replicated over tp). Layers without experts (`mlp_only_layers`, `decoder_sparse_step`) are
refused at tp > 1 by the checks."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.parallel import llama, qwen3
from dtrain.parallel.experts import ROUTERS, sparse_layer_plan
from dtrain.parallel.styles import WidthShardedNorm


def _olmoe_dense_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    width_norms = {"self_attn.q_norm": WidthShardedNorm(), "self_attn.k_norm": WidthShardedNorm()}
    return llama.layer_plan(sequence_parallel) | width_norms


class HeadShardedSinks(ParallelStyle):
    """GPT-OSS's attention module: its sinks (one logit per head, a parameter of the module itself)
    split over tp as the colwise q projection splits the heads (Shard(0)); then the dense plan's own
    style of the module (the sequence all-gather), if it has one."""

    def __init__(self, module_style: ParallelStyle | None) -> None:
        super().__init__()
        self.module_style = module_style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = distribute_tensor(module.sinks, device_mesh, [Shard(0)])
        module.register_parameter("sinks", nn.Parameter(sinks))
        return module if self.module_style is None else self.module_style._apply(module, device_mesh)


def _gpt_oss_dense_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    plan = llama.layer_plan(sequence_parallel)
    return plan | {"self_attn": HeadShardedSinks(plan.get("self_attn"))}


QWEN3_MOE = SimpleNamespace(model_plan=qwen3.model_plan, layer_plan=sparse_layer_plan(qwen3.layer_plan))
MIXTRAL = SimpleNamespace(model_plan=llama.model_plan, layer_plan=sparse_layer_plan(llama.layer_plan))
OLMOE = SimpleNamespace(model_plan=llama.model_plan, layer_plan=sparse_layer_plan(_olmoe_dense_plan))
GPT_OSS = SimpleNamespace(
    model_plan=llama.model_plan, layer_plan=sparse_layer_plan(_gpt_oss_dense_plan, ROUTERS["gpt_oss"])
)
