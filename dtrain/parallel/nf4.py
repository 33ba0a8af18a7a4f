"""bitsandbytes' NF4 format (`quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)`),
computed on any rows of a weight: a rank's shard after tensor parallel and FSDP, or the tp-local
piece FSDP gathers. Pure torch, on any device; no bitsandbytes needed to train.

The format, over the whole weight flattened row-major as bitsandbytes flattens it:
- blocks of 64 elements, each with its absmax; an element's code is the NF4 value nearest to
  `x · (1 / absmax)` (4 bits; two a byte, the first in the high nibble);
- double quantization: the mean of all the absmax values (`offset`) is subtracted, and the rest are
  quantized to bitsandbytes' 8-bit dynamic map in blocks of 256, each with its own fp32 absmax
  (`state2`): an element dequantizes to `NF4[code] · (dynamic[scale code] · state2 + offset)`.

The reference is bitsandbytes' pure-torch path (`bitsandbytes.backends.default`), which rounds to the
nearest code by midpoints after multiplying by the reciprocal, as bitsandbytes' CUDA kernel does. Its
CPU library (`quantize_blockwise` of libbitsandbytes_cpu, which `quantize_4bit` calls for the double
quantization on a CPU) finds the code by a table-driven binary search and picks a farther code for
about 1 in 1,100 scale codes; the 4-bit codes and the dequantization are the same on both paths.

A piece of a weight is described by its Layout: each row of a piece is a contiguous run of the
flattened whole weight, so an element's block is `(row start + column) // 64`. Row `i` of a piece
keeps one scale code per block its run touches (`slots` a row): blocks that straddle rows, tp ranks
or FSDP shards are kept by every row that touches them, with the same value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily

BLOCK = 64  # elements per absmax (bitsandbytes' blocksize)
SCALE_BLOCK = 256  # absmax values per second-level scale (compress_statistics=True)
# Rows are (de)quantized in chunks of about this many elements: the temporaries stay under about
# 6 bytes an element of a chunk (100 MB), with few enough chunks that a GPU's launches do not count
CHUNK_ELEMENTS = 1 << 24
# bitsandbytes' get_4bit_type("nf4"): the quantiles of a standard normal, normalised to [-1, 1]
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
ZERO_CODE = NF4_VALUES.index(0.0)  # what bitsandbytes packs into the unused half of an odd count's last byte


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """(NF4 values, their midpoints, the dynamic map, its midpoints, a byte's two NF4 values) on
    `device`, fp32. Real tensors even when first asked for under a fake mode (the planner's)."""
    with unset_fake_temporarily():
        nf4 = torch.tensor(NF4_VALUES, dtype=torch.float32)
        dynamic = dynamic_map()
        pairs = torch.stack((nf4.repeat_interleave(16), nf4.repeat(16)), dim=-1)  # high nibble first
        tables = (nf4, (nf4[:-1] + nf4[1:]) / 2, dynamic, (dynamic[:-1] + dynamic[1:]) / 2, pairs)
        return tuple(t.to(device) for t in tables)


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): 256 sorted
    values, an exponent and a shrinking fraction each (Dettmers, 8-bit approximations)."""
    data: list[float] = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


@dataclass(frozen=True)
class Layout:
    """A piece of a weight: the whole weight's shape, the piece's first element in it and its width
    (tensor parallel's local columns). Its rows are whole rows of the piece, from any row on.
    `part_row`: the first row in the whole weight of the parameter the piece is cut from (a part of
    a fused projection; 0 for a weight of its own)."""

    shape: tuple[int, int]
    origin: tuple[int, int]
    cols: int
    part_row: int = 0

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def blocks(self) -> int:
        """The whole weight's 64-blocks (the last one partial when numel is not a multiple of 64)."""
        return -(self.numel // -BLOCK)

    @property
    def groups(self) -> int:
        """The whole weight's 256-blocks of absmax values (one state2 value each)."""
        return -(self.blocks // -SCALE_BLOCK)

    @property
    def aligned(self) -> bool:
        """Every row run starts a block and holds whole blocks: the fast path (real models' shapes)."""
        return self.shape[1] % BLOCK == 0 and self.cols % BLOCK == 0 and self.origin[1] % BLOCK == 0

    @property
    def slots(self) -> int:
        """Scale codes kept a row: the most blocks a row run of `cols` elements can touch."""
        return self.cols // BLOCK if self.aligned else (self.cols + BLOCK - 2) // BLOCK + 1

    def row_starts(self, first: int, rows: int, device: torch.device) -> torch.Tensor:
        """The flat index in the whole weight of the first element of rows `first`... of the piece."""
        index = torch.arange(first, first + rows, device=device, dtype=torch.int64)
        return (self.origin[0] + index) * self.shape[1] + self.origin[1]

    def slot_blocks(self, first: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(block index of each row's slots, whether the slot is one its run touches)."""
        starts = self.row_starts(first, rows, device)
        blocks = starts[:, None] // BLOCK + torch.arange(self.slots, device=device)
        last = (starts + self.cols - 1) // BLOCK
        return blocks, blocks <= last[:, None]

    def element_slots(self, first: int, rows: int, device: torch.device) -> torch.Tensor:
        """The slot of each element of the rows (unaligned layouts only: aligned slots are col // 64)."""
        lead = self.row_starts(first, rows, device) % BLOCK
        return (lead[:, None] + torch.arange(self.cols, device=device)) // BLOCK


def row_chunks(layout: Layout, rows: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of about CHUNK_ELEMENTS elements each."""
    step = max(1, CHUNK_ELEMENTS // max(layout.cols, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def local_absmax(x: torch.Tensor, layout: Layout, first: int) -> torch.Tensor:
    """The absmax of every block of the whole weight over the elements of `x` (rows `first`... of the
    piece; 0 for blocks it does not touch): what the ranks reduce with max to agree on each block."""
    absmax = torch.zeros(layout.blocks, dtype=torch.float32, device=x.device)
    for start, stop in row_chunks(layout, x.shape[0]):
        rows = x[start:stop].float().abs()
        blocks, touched = layout.slot_blocks(first + start, stop - start, x.device)
        if layout.aligned:
            maxima = rows.reshape(stop - start, layout.slots, BLOCK).amax(-1)
        else:
            slots = layout.element_slots(first + start, stop - start, x.device)
            maxima = torch.zeros(blocks.shape, dtype=torch.float32, device=x.device)
            maxima.scatter_reduce_(1, slots, rows, "amax")
        absmax.scatter_reduce_(0, blocks[touched], maxima[touched], "amax")
    return absmax


def double_quantize(absmax: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole weight's absmax values → (8-bit scale codes, state2 absmax, offset), on the CPU
    whatever the device (the mean's summation order is then the same as the CPU reference's)."""
    absmax = absmax.detach().to("cpu", torch.float32, copy=True)
    if layout.numel % BLOCK:  # bitsandbytes stores a partial last block's absmax clamped
        absmax[-1] = absmax[-1].clamp(min=1e-38)
    offset = absmax.mean()
    centred = absmax - offset
    dynamic, bounds = _tables(torch.device("cpu"))[2:4]
    n, full = centred.numel(), centred.numel() - centred.numel() % SCALE_BLOCK
    state2 = F.pad(centred.abs(), (0, layout.groups * SCALE_BLOCK - n)).view(-1, SCALE_BLOCK).amax(-1)
    if n > full:  # a partial last group: its absmax stored clamped, its values divided by it
        state2[-1] = state2[-1].clamp(min=1e-38)
    scaled = torch.empty_like(centred)
    per = 1.0 / state2.clamp(min=1e-38)
    scaled[:full] = (centred[:full].view(-1, SCALE_BLOCK) * per[: full // SCALE_BLOCK, None]).reshape(-1)
    scaled[full:] = centred[full:] / state2[-1]
    codes = torch.bucketize(scaled.clamp(-1, 1), bounds, out_int32=True).to(torch.uint8)
    return codes, state2, offset.reshape(1)


def quantize_rows(x: torch.Tensor, absmax: torch.Tensor, layout: Layout, first: int) -> torch.Tensor:
    """The packed 4-bit codes of rows `first`... of the piece, (rows, ceil(cols / 2)) uint8, given the
    whole weight's absmax values (fp32, agreed over the ranks)."""
    nf4_bounds = _tables(x.device)[1]
    packed = torch.empty((x.shape[0], -(layout.cols // -2)), dtype=torch.uint8, device=x.device)
    last_partial = layout.numel % BLOCK != 0
    for start, stop in row_chunks(layout, x.shape[0]):
        rows = x[start:stop].float()
        blocks, _ = layout.slot_blocks(first + start, stop - start, x.device)
        blocks = blocks.clamp(max=layout.blocks - 1)
        reciprocal = 1.0 / absmax[blocks].clamp(min=1e-38)  # bitsandbytes: x * (1 / absmax) ...
        if layout.aligned:
            scaled = (rows.reshape(stop - start, layout.slots, BLOCK) * reciprocal[..., None]).view_as(rows)
        else:
            slots = layout.element_slots(first + start, stop - start, x.device)
            scaled = rows * reciprocal.gather(1, slots)
            if last_partial:  # ... but divides the elements of a partial last block
                in_last = blocks.gather(1, slots) == layout.blocks - 1
                scaled = torch.where(in_last, rows / absmax[-1].clamp(min=1e-38), scaled)
        codes = torch.bucketize(scaled.clamp(-1, 1), nf4_bounds, out_int32=True).to(torch.uint8)
        packed[start:stop] = pack(codes)
    return packed


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(rows, n) 4-bit codes → (rows, ceil(n / 2)) bytes, the even column in the high nibble."""
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1), value=ZERO_CODE)
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """pack's inverse: (rows, cols) codes."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).view(*packed.shape[:-1], -1)[..., :cols]


def scale_codes(codes: torch.Tensor, layout: Layout, first: int, rows: int) -> torch.Tensor:
    """The (rows, slots) scale codes of rows `first`... from the whole weight's codes (0 in slots
    a row does not touch)."""
    blocks, touched = layout.slot_blocks(first, rows, codes.device)
    return torch.where(touched, codes[blocks.clamp(max=layout.blocks - 1)], 0).to(torch.uint8)


def scale_groups(layout: Layout, first: int, rows: int, device: torch.device) -> torch.Tensor:
    """The state2 group (256-block of absmax values) of each of the rows' slots: (rows, slots) int64.
    What dequantization indexes state2 with; FSDP's gathered piece keeps it (qlora.NF4Tensor)."""
    blocks, _ = layout.slot_blocks(first, rows, device)
    return blocks.clamp(max=layout.blocks - 1) // SCALE_BLOCK


def block_scales(
    scales: torch.Tensor, state2: torch.Tensor, offset: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor:
    """Each slot's absmax as bitsandbytes dequantizes it: dynamic[code] · state2[group] + offset."""
    dynamic = _tables(scales.device)[2]
    return dynamic[scales.long()] * state2[groups] + offset


def dequantize_rows(
    packed: torch.Tensor,
    scales: torch.Tensor,
    state2: torch.Tensor,
    offset: torch.Tensor,
    layout: Layout,
    first: int,
    out: torch.Tensor,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `first`... of the piece, dequantized into `out` (rows, cols) in its dtype:
    NF4[code] · absmax in fp32, then rounded once to the dtype (bitsandbytes' dequantize_4bit).
    `groups`: scale_groups of these rows, if kept."""
    pairs = _tables(packed.device)[4]
    if groups is None:
        groups = scale_groups(layout, first, packed.shape[0], packed.device)
    for start, stop in row_chunks(layout, packed.shape[0]):
        values = F.embedding(packed[start:stop].int(), pairs).flatten(-2)[:, : layout.cols]
        absmax = block_scales(scales[start:stop], state2, offset, groups[start:stop])
        if layout.aligned:
            values = values.view(stop - start, layout.slots, BLOCK).mul_(absmax[..., None])
        else:
            slots = layout.element_slots(first + start, stop - start, out.device)
            values = values.mul_(absmax.gather(1, slots))
        out[start:stop] = values.view(stop - start, layout.cols)
    return out


def bnb_codes(codes: torch.Tensor) -> torch.Tensor:
    """The whole weight's (R, C) 4-bit codes packed as bitsandbytes packs them: flat, two a byte,
    as a (ceil(numel / 2), 1) uint8 column."""
    return pack(codes.reshape(1, -1)).reshape(-1, 1)


@torch.no_grad()
def round_trip(weight: torch.Tensor) -> torch.Tensor:
    """A whole weight quantized and dequantized in one process, in its dtype: the values an NF4 base
    computes with (the benchmark's baseline trains on them)."""
    layout = Layout(tuple(weight.shape), (0, 0), weight.shape[1])
    absmax = local_absmax(weight, layout, 0)
    codes, state2, offset = double_quantize(absmax, layout)
    packed = quantize_rows(weight, absmax, layout, 0)
    scales = scale_codes(codes.to(weight.device), layout, 0, weight.shape[0])
    state2, offset = state2.to(weight.device), offset.to(weight.device)
    return dequantize_rows(packed, scales, state2, offset, layout, 0, torch.empty_like(weight))
