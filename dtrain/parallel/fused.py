"""Fused projections (Phi-3's `qkv_proj` and `gate_up_proj`) split into separate modules when the
meta model is built, so that each part is a plain colwise Linear sharded by its own heads (a
colwise split of the fused matrix would hand tp rank 0 all of q), DCP checkpoints stay
independent of the mesh, and HF weights still load and export under HF's fused names.

A split model carries `FUSED_ATTR`: {part name: (HF name, first row in the HF matrix)}. HF
weights are read into each part from its rows of the fused tensor; export and the tests
concatenate the parts back in HF's order.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtrain.config import ConfigError
from dtrain.distributed import gather_whole

FUSED_ATTR = "dtrain_fused_parts"


def split_linear(
    module: nn.Module, fused: str, parts: dict[str, int], prefix: str
) -> dict[str, tuple[str, int]]:
    """Replace `module.<fused>` by one bias-free Linear per part ({name: rows}, in HF's row order)
    on the same device; returns {part parameter name: (fused parameter name, first row)}."""
    weight = getattr(module, fused).weight
    delattr(module, fused)
    names, row = {}, 0
    for name, rows in parts.items():
        setattr(module, name, nn.Linear(weight.shape[1], rows, bias=False, device=weight.device))
        names[f"{prefix}{name}.weight"] = (f"{prefix}{fused}.weight", row)
        row += rows
    if row != weight.shape[0]:
        raise ValueError(f"{prefix}{fused}: parts of {row} rows, the fused weight has {weight.shape[0]}")
    return names


def _local_slices(param: torch.Tensor, shape: torch.Size | None = None) -> tuple[slice, ...]:
    shape = shape or param.shape
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in shape)
    local, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))


@torch.no_grad()
def load_parts(model: nn.Module, state: dict[str, torch.Tensor], where: dict[str, Path]) -> None:
    """Fill each rank's shard of the split parts (popped from `state`) from its rows of the fused
    HF tensors (`where`: each tensor's file): only this rank's rows are read."""
    parts = getattr(model, FUSED_ATTR, {})
    for name, (fused, first) in parts.items():
        param = state.pop(name, None)
        if param is None:  # not among the tensors being read (QLoRA reads a layer's NF4 weights apart)
            continue
        if fused not in where:
            folder = next(iter(where.values())).parent
            raise ConfigError(f"{folder}: no tensor {fused!r} in the safetensors files")
        rows, columns = _local_slices(param)
        with safe_open(where[fused], "pt") as reader:
            block = reader.get_slice(fused)[first + rows.start : first + rows.stop, columns]
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(block)


def fuse(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under HF's names: the parts concatenated into their fused tensors, in HF's order and
    in the model's (collectives: the same on every rank). A DTensor part gives a DTensor laid out
    like it (gathered one fused matrix at a time); plain tensors give a plain tensor."""
    parts = getattr(model, FUSED_ATTR, {})
    if not parts:
        return state
    out = {name: tensor for name, tensor in state.items() if name not in parts}
    for fused, names in groups(model).items():
        first = state[names[0]]
        full = torch.cat([gather_whole(state[name]) for name in names])
        if isinstance(first, DTensor):
            full = DTensor.from_local(
                full[_local_slices(first, full.shape)].contiguous(),
                first.device_mesh,
                first.placements,
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
        out[fused] = full
    return out


def groups(model: nn.Module) -> dict[str, list[str]]:
    """{HF's fused parameter name: its parts' parameter names in HF's row order} ({} unsplit)."""
    found: dict[str, list[str]] = {}
    for name, (fused, _) in sorted(getattr(model, FUSED_ATTR, {}).items(), key=lambda item: item[1]):
        found.setdefault(fused, []).append(name)
    return found
