"""QLoRA's frozen base (lora.base_dtype=nf4): every adapted Linear's weight stored in bitsandbytes'
NF4 (dtrain/parallel/nf4.py) on each rank's shard, gathered by FSDP2 as NF4 bytes and dequantized
after the gather, for forward and again for backward.

The weight is a parameter whose local tensor is an NF4Tensor: its rows of the weight in NF4 (packed
codes, scale codes, and the whole weight's state2 and offset). It is made on the meta device right
after the TP plan and the adapters (`to_nf4`), so FSDP shards its rows as any weight's and `to_empty`
allocates NF4 bytes, never a dense weight. FSDP2's all-gather extension (`fsdp_pre_all_gather`,
`fsdp_post_all_gather`, as torchao's NF4Tensor) gathers the codes and scale codes of the tp-local
piece and returns the dequantized piece: the module computes with a plain weight (torch.compile and
activation checkpointing see nothing else), which FSDP frees after forward and gathers again for
backward.

Without FSDP (one process, or tensor parallel alone: parallelize applies no fully_shard) nothing
gathers: the parameter stays NF4 and its module (QLoraLinear) dequantizes the tp-local piece for the
matmul, in forward and again in backward (`nf4_linear`), so no dense weight outlives its matmul, as
with FSDP.

Weights come in a decoder layer at a time, dense in the training precision, and are quantized on
each rank's shard (`quantize_`): the ranks agree on each block's absmax with one all-reduce (max)
over the whole weight's absmax values, 1/64 of the weight; the double quantization runs on those on
every rank alike. So the codes, scales and the dequantized base are single-process bitsandbytes'
bit for bit on every mesh.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtrain.config import ConfigError
from dtrain.parallel import fused, lora, nf4

aten = torch.ops.aten
INNER = ("packed", "state2", "offset")


class NF4Tensor(torch.Tensor):
    """Rows `first`... of a tp-local piece of a weight (nf4.Layout), in NF4; looks like a `dtype`
    tensor of shape (rows, cols). Supports what FSDP2 does to a frozen parameter's local tensor
    (chunk, pad, copy, view, allocate) and its all-gather extension; any other op is refused."""

    packed: torch.Tensor  # (rows, ceil(cols / 2) + slots) uint8: a row's codes, then its scale codes
    state2: torch.Tensor  # (groups,) fp32: the whole weight's second-level absmax
    offset: torch.Tensor  # (1,) fp32: the mean of the whole weight's absmax values
    piece: nf4.Layout  # which piece of which weight
    first: int  # the first row's row in the piece

    @staticmethod
    def __new__(cls, packed, state2, offset, layout, first, shape, dtype):  # noqa: ANN001, ANN205
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=packed.device)

    def __init__(self, packed, state2, offset, layout, first, shape, dtype) -> None:  # noqa: ANN001
        self.packed, self.state2, self.offset = packed, state2, offset
        self.piece, self.first = layout, first
        self.gathered_groups: torch.Tensor | None = None  # nf4.scale_groups of the gathered piece

    @property
    def codes(self) -> torch.Tensor:
        return self.packed[:, : _code_bytes(self.piece)]

    @property
    def scales(self) -> torch.Tensor:
        return self.packed[:, _code_bytes(self.piece) :]

    @classmethod
    def empty(cls, layout: nf4.Layout, rows: int, dtype: torch.dtype, device: torch.device, first: int = 0):
        packed = torch.empty((rows, _code_bytes(layout) + layout.slots), dtype=torch.uint8, device=device)
        state2 = torch.empty(layout.groups, dtype=torch.float32, device=device)
        offset = torch.empty(1, dtype=torch.float32, device=device)
        return cls(packed, state2, offset, layout, first, (rows, layout.cols), dtype)

    def _with(self, rows: slice = slice(None), shape: tuple[int, ...] | None = None) -> NF4Tensor:
        """`rows` of this tensor (views of its bytes), seen as `shape` (default: rows × cols)."""
        packed = self.packed[rows]
        shape = shape or (packed.shape[0], self.piece.cols)
        first = self.first + (rows.start or 0)
        return NF4Tensor(packed, self.state2, self.offset, self.piece, first, shape, self.dtype)

    def __repr__(self) -> str:  # noqa: D105
        return f"NF4Tensor({tuple(self.shape)}, {self.dtype}, rows from {self.first} of {self.piece})"

    def __tensor_flatten__(self):  # noqa: ANN204
        return list(INNER), (self.piece, self.first, tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):  # noqa: ANN001, ANN205
        layout, first, shape, dtype = meta
        return NF4Tensor(*(inner[name] for name in INNER), layout, first, shape, dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{func} on an NF4 base weight: lora.base_dtype=nf4 stores it for FSDP's all-gather, "
                "which returns it dequantized, or for QLoraLinear, which dequantizes it; compute with that"
            )
        return handler(*args, **kwargs)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """These rows, dense, in `dtype` (default: this tensor's): one operator (dequantize_op), which
        torch.compile keeps whole in a compiled layer."""
        piece = self.piece
        layout = [*piece.shape, *piece.origin, piece.cols, piece.part_row]
        return dequantize_op(self.packed, self.state2, self.offset, layout, self.first, dtype or self.dtype)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN201
        """FSDP gathers the bytes: packed codes and scale codes, one uint8 tensor (FSDP2 takes one
        input at world size 1), never a dense weight."""
        return (self.packed,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # noqa: ANN001, ANN201
        """The gathered tp-local piece (its rows from 0), dequantized in the compute dtype: into
        FSDP's unsharded parameter (`out`) from the second gather on."""
        (data,) = outputs
        width = _code_bytes(self.piece)
        codes, scales = data[:, :width], data[:, width:]
        if self.gathered_groups is None:  # the piece's state2 index, the same at every gather
            self.gathered_groups = nf4.scale_groups(self.piece, 0, data.shape[0], data.device)
        args = (codes, scales, self.state2, self.offset, self.piece, 0)
        if out is None:
            dense = torch.empty((data.shape[0], self.piece.cols), dtype=param_dtype, device=data.device)
            nf4.dequantize_rows(*args, dense, self.gathered_groups)
            return dense, (dense,)
        dense = out._local_tensor if isinstance(out, DTensor) else out
        # The same values again, into the tensor forward's autograd saved (FSDP freed its storage)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dense):
            nf4.dequantize_rows(*args, dense, self.gathered_groups)
        return None


def _code_bytes(layout: nf4.Layout) -> int:
    return -(layout.cols // -2)


@torch.library.custom_op("dtrain::nf4_dequantize", mutates_args=())
def dequantize_op(
    packed: torch.Tensor,
    state2: torch.Tensor,
    offset: torch.Tensor,
    layout: list[int],
    first: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """NF4Tensor.dequantize on its plain tensors: `packed` (rows, code bytes + slots), the piece's
    Layout as [whole rows, whole cols, origin row, origin col, cols, part_row], `first` its first
    row. An operator of its own: torch.compile traces no NF4 arithmetic (its lookup tables are
    constants it would not see), only this call."""
    piece = nf4.Layout((layout[0], layout[1]), (layout[2], layout[3]), layout[4], layout[5])
    width = _code_bytes(piece)
    rows = packed.shape[0]
    out = torch.empty((rows, piece.cols), dtype=dtype, device=packed.device)
    groups = _scale_groups(piece, first, rows, packed.device)
    codes, scales = packed[:, :width], packed[:, width:]
    return nf4.dequantize_rows(codes, scales, state2, offset, piece, first, out, groups)


@dequantize_op.register_fake
def _(packed, state2, offset, layout, first, dtype):  # noqa: ANN001, ANN202
    return packed.new_empty((packed.shape[0], layout[4]), dtype=dtype)


@functools.lru_cache(maxsize=4096)
def _scale_groups(piece: nf4.Layout, first: int, rows: int, device: torch.device) -> torch.Tensor:
    """nf4.scale_groups of a piece's rows: the same at every dequantization (twice a step each)."""
    return nf4.scale_groups(piece, first, rows, device)


def _alias(self: NF4Tensor, *args, **kwargs) -> NF4Tensor:  # noqa: ANN002, ANN003
    return self._with()


def _view(self: NF4Tensor, size: list[int]) -> NF4Tensor:
    """FSDP keeps a flat view of a shard (used for plain tensors' all-gather only)."""
    if list(size) in ([-1], [self.numel()]):
        return self._with(shape=(self.numel(),))
    if list(size) != list(self.shape):
        raise NotImplementedError(f"view of an NF4 base weight {tuple(self.shape)} as {size}")
    return self._with()


def _rows(self: NF4Tensor, dim: int = 0, start: int | None = 0, end: int | None = None, step: int = 1):
    if dim != 0 or step != 1:
        raise NotImplementedError("an NF4 base weight splits by whole rows only")
    start, end, _ = slice(start, end).indices(self.shape[0])
    return self._with(slice(start, end))


def _split(self: NF4Tensor, size: int, dim: int = 0) -> list[NF4Tensor]:
    return [_rows(self, dim, start, start + size) for start in range(0, self.shape[0], size)]


def _split_with_sizes(self: NF4Tensor, sizes: list[int], dim: int = 0) -> list[NF4Tensor]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_rows(self, dim, start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _new_zeros(self: NF4Tensor, size: list[int], **kwargs) -> NF4Tensor:  # noqa: ANN003
    device = kwargs.get("device") or self.device
    tensor = NF4Tensor.empty(self.piece, size[0], self.dtype, device)
    for name in INNER:
        getattr(tensor, name).zero_()
    return tensor


def _empty_like(self: NF4Tensor, **kwargs) -> NF4Tensor:  # noqa: ANN003
    device = kwargs.get("device") or self.device
    return NF4Tensor.empty(self.piece, self.shape[0], self.dtype, device, self.first)


def _copy(self: NF4Tensor, source: torch.Tensor, non_blocking: bool = False) -> NF4Tensor:
    if not isinstance(source, NF4Tensor):
        raise NotImplementedError("copying dense values into an NF4 base weight: quantize_ them")
    for name in INNER:
        getattr(self, name).copy_(getattr(source, name))
    return self


def _to_copy(self: NF4Tensor, **kwargs) -> torch.Tensor:  # noqa: ANN003
    """`.float()`, `.to(dtype)`: the rows dequantized (what a merge into the base starts from)."""
    return self.dequantize(kwargs.get("dtype")).to(kwargs.get("device") or self.device)


_OPS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.view.default: _view,
    aten.slice.Tensor: _rows,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.new_zeros.default: _new_zeros,
    aten.empty_like.default: _empty_like,
    aten.copy_.default: _copy,
    aten.is_pinned.default: lambda self, *args, **kwargs: False,
    aten._to_copy.default: _to_copy,
}


def local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def is_nf4(param: torch.Tensor) -> bool:
    return isinstance(local(param), NF4Tensor)


def _origin(weight: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """(this rank's first element of `weight` in the whole weight, its local shape)."""
    if not isinstance(weight, DTensor):
        return (0, 0), tuple(weight.shape)
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return tuple(offset), tuple(shape)


class QLoraLinear(lora.LoraLinear):
    """A LoraLinear whose base weight is stored in NF4. Under FSDP its forward sees the gathered
    weight, already dense (fsdp_post_all_gather); without FSDP the NF4 parameter itself, which
    nf4_linear dequantizes for each matmul."""

    def base(self, x: torch.Tensor) -> torch.Tensor:
        if not is_nf4(self.weight):
            return super().base(x)
        return _NF4Linear.apply(x, self.weight, self.bias)


class _NF4Linear(torch.autograd.Function):
    """F.linear(x, the NF4 weight dequantized, bias) without keeping the dense weight for backward: it
    is dequantized again there (the weight and bias are frozen: x's gradient only). On DTensors at
    tp > 1 the matmuls are DTensor's, with the placements the TP style gives a dense weight."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        ctx.save_for_backward(weight)
        return F.linear(x, dequantized(weight), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (weight,) = ctx.saved_tensors
        dense = dequantized(weight)
        return grad.to(dense.dtype) @ dense, None, None


def to_nf4(linear: nn.Linear, whole: tuple[int, int], first_row: int = 0) -> None:
    """Replace `linear`'s meta weight (TP applied, before FSDP) by its NF4 placeholder, in place.
    `whole`: the shape of the weight bitsandbytes quantizes, of which this one holds the rows from
    `first_row` on (a part of a fused projection, dtrain/parallel/fused.py; else its own shape)."""
    weight = linear.weight
    origin, shape = _origin(weight)
    layout = nf4.Layout(whole, (first_row + origin[0], origin[1]), shape[1], first_row)
    placeholder = NF4Tensor.empty(layout, shape[0], weight.dtype, torch.device("meta"))
    if isinstance(weight, DTensor):
        placeholder = DTensor.from_local(
            placeholder, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
            stride=weight.stride(),
        )  # fmt: skip
    linear.weight = nn.Parameter(placeholder, requires_grad=False)
    if isinstance(linear, lora.LoraLinear):
        linear.__class__ = QLoraLinear


def quantize_base(model: nn.Module, shards: int) -> None:
    """Every adapted Linear's base weight (lora.adapter_modules) becomes an NF4 placeholder. The parts
    of a fused projection are pieces of the one fused weight bitsandbytes quantizes. `shards`: the
    ranks FSDP will shard the rows over, which must divide every weight's tp-local rows (FSDP2 gathers
    an extension's bytes from even shards only)."""
    modules = lora.adapter_modules(model)
    for name, module in modules.items():
        rows = _origin(module.weight)[1][0]
        if rows % shards:
            raise ConfigError(
                f"lora.base_dtype=nf4: {name}'s {rows} rows (on each tp rank) do not split evenly over "
                f"the {shards} FSDP ranks (parallel.dp_shard x parallel.cp); FSDP2 gathers NF4 shards of "
                "equal size only: choose a dp_shard that divides them"
            )
    parts = lora.fused_parts(model)
    fused_rows: dict[str, int] = {}
    for name, module in modules.items():
        if name in parts:
            fused_rows[parts[name][0]] = fused_rows.get(parts[name][0], 0) + module.weight.shape[0]
    for name, module in modules.items():
        fused, first = parts.get(name, (name, 0))
        whole = (fused_rows[fused], module.weight.shape[1]) if name in parts else tuple(module.weight.shape)
        to_nf4(module, whole, first)


def nf4_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """{HF name: parameter} of the NF4 base weights, in the model's order."""
    modules = lora.adapter_modules(model).items()
    return {f"{name}.weight": module.weight for name, module in modules if is_nf4(module.weight)}


def by_layer(params: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The NF4 weights grouped by decoder layer (`...layers.N.`), in the model's order."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in params.items():
        match = re.match(r"(.*\.\d+)\.", name)
        groups.setdefault(match.group(1) if match else name, {})[name] = param
    return list(groups.values())


def dense_like(param: torch.Tensor) -> torch.Tensor:
    """An uninitialised dense tensor sharded as `param` (a DTensor for DTensor parameters): what the
    weight is read into before quantize_."""
    inner = local(param)
    dense = torch.empty(inner.shape, dtype=inner.dtype, device=inner.device)
    if not isinstance(param, DTensor):
        return dense
    return DTensor.from_local(
        dense, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def whole_weights(model: nn.Module) -> dict[str, str]:
    """{NF4 parameter name: the name of the weight bitsandbytes quantizes (a fused one for a part)}."""
    parts = getattr(model, fused.FUSED_ATTR, {})
    return {name: parts.get(name, (name, 0))[0] for name in nf4_parameters(model)}


@torch.no_grad()
def quantize_all(model: nn.Module, dense: dict[str, torch.Tensor]) -> None:
    """Collective. Quantize the NF4 parameters named in `dense` from their dense shards (each the
    parameter's local values, or a DTensor of them), a whole weight at a time (a fused weight's parts
    together), in `dense`'s order: the same on every rank."""
    params, wholes = nf4_parameters(model), whole_weights(model)
    groups: dict[str, list[str]] = {}
    for name in dense:
        groups.setdefault(wholes[name], []).append(name)
    for names in groups.values():
        quantize_([(params[name], dense[name]) for name in names])


@torch.no_grad()
def quantize_(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Collective (every rank, the same weights in the same order). Quantize this rank's shards of
    one whole weight (its pieces: (NF4 parameter, dense shard) pairs): the whole weight's block absmax
    values reduced with max over all ranks, then this shard's NF4 codes and every rank alike the
    double quantization of all the absmax values."""
    layout = local(pieces[0][0]).piece
    device = local(pieces[0][0]).device  # the NF4 storage's (an initial draw may come from the host)
    absmax = None
    for param, dense in pieces:
        tensor = local(param)
        origin, _ = _origin(param)
        tensor.first = tensor.piece.part_row + origin[0] - tensor.piece.origin[0]  # in the piece
        partial = nf4.local_absmax(local(dense).to(device), tensor.piece, tensor.first)
        absmax = partial if absmax is None else torch.maximum(absmax, partial)
    assert absmax is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
    codes, state2, offset = nf4.double_quantize(absmax, layout)
    codes = codes.to(device)
    for param, dense in pieces:
        tensor, values = local(param), local(dense).to(device)
        tensor.codes.copy_(nf4.quantize_rows(values, absmax, tensor.piece, tensor.first))
        tensor.scales.copy_(nf4.scale_codes(codes, tensor.piece, tensor.first, values.shape[0]))
        tensor.state2.copy_(state2)
        tensor.offset.copy_(offset)


def dequantized(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An NF4 parameter's shard dequantized, as a tensor sharded like the parameter."""
    dense = local(param).dequantize(dtype)
    if not isinstance(param, DTensor):
        return dense
    return DTensor.from_local(
        dense, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def storage_bytes(model: nn.Module) -> int:
    """This rank's bytes of NF4 storage (codes, scale codes, state2, offset) over the model."""
    return sum(
        sum(getattr(local(p), name).untyped_storage().nbytes() for name in INNER)
        for p in nf4_parameters(model).values()
    )


def bnb_quant_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Collective. An NF4 parameter's whole weight in bitsandbytes' QuantState layout, gathered on
    every rank: `packed` ((numel + 1) // 2, 1) uint8 as quantize_4bit packs it, `absmax` the 8-bit
    scale codes (blocks,), `state2` (groups,) and `offset` ()."""
    tensor = local(param)
    layout = tensor.piece
    pieces: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    mine = (tensor.first, tensor.piece, tensor.codes.cpu(), tensor.scales.cpu())
    if dist.is_initialized():
        dist.all_gather_object(pieces, mine)
    else:
        pieces = [mine]
    codes = torch.zeros(layout.shape, dtype=torch.uint8)
    scales = torch.zeros(layout.blocks, dtype=torch.uint8)
    for first, piece, packed, scale_codes in pieces:
        rows = packed.shape[0]
        top, left = piece.origin[0] + first, piece.origin[1]
        codes[top : top + rows, left : left + piece.cols] = nf4.unpack(packed, piece.cols)
        blocks, touched = piece.slot_blocks(first, rows, torch.device("cpu"))
        scales[blocks[touched]] = scale_codes[touched]
    return {
        "packed": nf4.bnb_codes(codes),
        "absmax": scales,
        "state2": tensor.state2.cpu(),
        "offset": tensor.offset.cpu().reshape(()),
    }
