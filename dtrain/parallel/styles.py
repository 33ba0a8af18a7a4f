"""Parallel styles torch does not ship."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp (so they live on the 2-D mesh like all others); inputs and
    outputs stay plain tensors that are identical on every tp rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, input_fn=_inputs_to_replicate, output_fn=_output_to_local
        )


def _inputs_to_replicate(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _is_plain_tensor(x) else x
        for x in inputs
    )


def _output_to_local(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _is_plain_tensor(x: Any) -> bool:
    return hasattr(x, "shape") and not isinstance(x, DTensor)


class HeadShardedNorm(ParallelStyle):
    """A norm over head_dim applied to the local heads of a colwise projection (Qwen3's and Gemma 3's
    q_norm, k_norm). Its weight is replicated over tp; its input is marked sharded over the heads,
    so the weight's gradient is summed over every tp rank's heads instead of kept per rank.
    `heads_dim` counts from the end: -2 for (batch, seq, heads, head_dim) (Qwen3), -3 for (batch,
    heads, seq, head_dim) (Gemma 3 normalises after the transpose)."""

    def __init__(self, heads_dim: int = -2) -> None:
        super().__init__()
        self.heads_dim = heads_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, input_fn=self._inputs_to_head_shards, output_fn=_output_to_local
        )

    def _inputs_to_head_shards(
        self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh
    ) -> tuple[Any, ...]:
        # the heads dimension is what the colwise projection split
        return tuple(
            DTensor.from_local(x, mesh, [Shard(x.ndim + self.heads_dim)], run_check=False)
            if _is_plain_tensor(x)
            else x
            for x in inputs
        )


class WidthShardedNorm(ParallelStyle):
    """An RMSNorm over the whole projected width of a colwise projection (OLMo 2/3's q_norm and
    k_norm normalise all heads together, before the head reshape). Each tp rank holds only its
    heads' columns, so a norm of those alone would be another model: the input is marked sharded
    over its last dimension and the weight sharded like the columns (Shard(0)), and DTensor then
    all-reduces the mean of squares over tp; each rank keeps the gradient of its own columns."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_shard_weight_rows,
            input_fn=_inputs_to_width_shards,
            output_fn=_output_to_local,
        )


def _shard_weight_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def _inputs_to_width_shards(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Shard(x.ndim - 1)], run_check=False) if _is_plain_tensor(x) else x
        for x in inputs
    )
