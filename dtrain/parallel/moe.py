"""Tensor-parallel plans of the mixture-of-experts families and the styles of their sparse block.

Each plan is its dense relative's attention table (Qwen3-MoE: Qwen3's, per-head q/k norms; Mixtral:
Llama's; OLMoE: Llama's with OLMo 2's whole-width q/k norms; GPT-OSS: Llama's, its q/k/v/o biases
sharded with their weights, its per-head attention sinks split over tp as the q heads are) with the
sparse block's styles in place of the MLP's: each tp rank routes its sequence-parallel tokens, the
router and the experts replicated over tp (the experts by experts.shard_experts). Layers without
experts (`mlp_only_layers`, `decoder_sparse_step`) are refused at tp > 1 by the checks."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from dtrain.parallel import llama, qwen3
from dtrain.parallel.experts import ROUTERS
from dtrain.parallel.styles import WidthShardedNorm


class TokenShardedRouter(ParallelStyle):
    """The router at tp > 1: its weight replicated over tp, its input this tp rank's tokens (marked
    Shard(0) over tp, so the weight's gradient is summed over every rank's tokens); its outputs (logits,
    weights, expert indices) this rank's, as plain tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_tokens_to_shards, output_fn=_outputs_to_local)


def _tokens_to_shards(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x.reshape(-1, x.shape[-1]), mesh, [Shard(0)], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _outputs_to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return tuple(x.to_local() if isinstance(x, DTensor) else x for x in outputs)


class SequenceShardedBlock(ParallelStyle):
    """The sparse MoE block at tp > 1 with sequence parallel: it takes the norm's sequence-sharded
    output and works on this tp rank's tokens as a plain tensor; its output is this rank's part of
    the sequence, as the residual stream is."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_to_local_tokens)
        return module


def _to_local_tokens(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)


def sparse_layer_plan(
    dense: Callable[[bool], dict[str, ParallelStyle]], router: str = "gate"
) -> Callable[[bool], dict]:
    """A family's TP layer plan with its MLP styles replaced by the sparse block's: the block works on
    this tp rank's sequence-parallel tokens, the router (`mlp.<router>`, its bias too) replicated over
    tp (the experts are replicated over tp by shard_experts)."""

    def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        plan = {key: style for key, style in dense(sequence_parallel).items() if key.split(".")[0] != "mlp"}
        return plan | {"mlp": SequenceShardedBlock(), f"mlp.{router}": TokenShardedRouter()}

    return layer_plan


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
