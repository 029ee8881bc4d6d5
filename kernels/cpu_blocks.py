"""A GGUF's quantized blocks, run as the file stores them: the packed any-M GEMM's block
formats (kernels/cpu/gemm.h GEMM_Q41P..GEMM_Q6KP) and their panels.

A weight [n, k] of GGUF blocks (uint8 [n, row_bytes], rows in Hugging Face order) is
repacked once at load, losslessly, into panels of 16 output columns; panel p is k / G
groups of `group_bytes`, one group per block of G weights (32; 256 for the K-quants)
holding that block of the panel's 16 columns. Every format keeps its integer codes q as
unsigned bits, four consecutive k of one column in one 32-bit lane, so one `vpdpbusd`
multiplies 16 columns by 4 bytes of x (x quantized to int8 per 32, or per 256 for the
K-quants: `x_group`, q4_1.h):

  nibble chunks (256 bytes per 32 weights): chunk j (0..3) is 64 bytes, column c at bytes
    4 c .. 4 c + 3, byte t holding q[4 j + t] in its low half and q[16 + 4 j + t] in its
    high half (q indexed within the 32-block);
  byte chunks (Q8_0, 512 bytes per 32): for j = 0..3 a low chunk (column c's 4 bytes:
    q[4 j + t]) then a high chunk (q[16 + 4 j + t]); Q8_0's signed q stored as q + 128;
  bit planes (64 bytes per 32 weights): Q5_K's one plane of bit 4, column c's byte t
    holding that bit of q[4 j + t] at bit 2 j and of q[16 + 4 j + t] at bit 2 j + 1; Q6_K's
    two planes of bit pairs, the low plane's byte t holding bits 4-5 of q[4 j + t] at bits
    2 j, 2 j + 1 and the high plane's those of q[16 + 4 j + t] (so chunk j's two upper bits
    of a half come to bits 4-5 with one shift, whatever j).

Per group, before its codes, every column's fields (16 values each, column order):
  q4_0 (288):  d fp16 [0, 32); nibbles [32, 288)                         w = d (q - 8)
  q4_1 (320):  d fp16 [0, 32), m fp16 [32, 64); nibbles [64, 320)          w = d q + m
  q8_0 (544):  d fp16 [0, 32); byte chunks [32, 544)                      w = d (q - 128)
  q4_k (2368): d [0, 32), dmin [32, 64) fp16; sc u8 [64, 192) as [8 sub-blocks][16
               columns], mn u8 [192, 320) as [4 pairs of sub-blocks][16 columns][2];
               sub-block s's nibbles at 320 + 256 s
                                                           w = d sc_s q - dmin mn_s
  q5_k (2880): as q4_k; sub-block s at 320 + 320 s: nibbles, then its bit-4 plane
  q6_k (3360): d fp16 [0, 32); sc int8 [32, 288) as [16 sub-blocks of 16][16 columns];
               32-block s at 288 + 384 s: nibbles, low and high bit-pair planes
                                                           w = d sc_(s16) (q - 32)
The fp16 fields are the file's bytes; the 6-bit scales of Q4_K/Q5_K are unpacked to bytes
(144 -> 148 bytes per 256 weights, 176 -> 180); the others keep the file's size.

A weight may be several parts of different types (a fused q/k/v whose v is Q6_K and q, k
Q4_K: a Q4_K_M file), back to back in one uint8 buffer (`BlockLayout`); every part but the
last has a multiple of 16 rows, so no panel straddles two.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize
from torch import Tensor

from aioengine.kernels import cpu_build, cpu_layout
from aioengine.kernels.block_fields import CODE_BITS, Fields, file_blocks, file_fields
from aioengine.kernels.int8_rows import quantize_dequantize_blocks

PANEL = 16
# Bumped whenever a group's byte layout changes (start-up caches of packed bytes key on it).
LAYOUT_VERSION = 3


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: GT
    block_weights: int  # weights per file block and per panel group
    block_bytes: int  # bytes of one file block
    group_bytes: int  # bytes of one panel group (16 columns' block)
    code: int  # gemm.h's GEMM_*P


BLOCK_TYPES: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("q4_1", GT.Q4_1, 32, 20, 320, 8),
    BlockFormat("q8_0", GT.Q8_0, 32, 34, 544, 10),
    BlockFormat("q4_0", GT.Q4_0, 32, 18, 288, 11),
    BlockFormat("q4_k", GT.Q4_K, 256, 144, 2368, 12),
    BlockFormat("q5_k", GT.Q5_K, 256, 176, 2880, 13),
    BlockFormat("q6_k", GT.Q6_K, 256, 210, 3360, 14),
)}
_BY_GGML = {f.ggml_type: f.name for f in BLOCK_TYPES.values()}


def x_group(block_type: str) -> int:
    """The values per x scale a block type's GEMM reads: 256 for the K-quants (as ggml's
    Q8_K: their sub-block scales then combine in integers), else 32."""
    return 256 if BLOCK_TYPES[block_type].block_weights == 256 else 32


def x_runs(parts: Sequence[BlockPart]) -> list[tuple[BlockPart, ...]]:
    """Consecutive parts that read x alike (one `x_group`), at most PROJ_MAX_PARTS a run:
    one kernel call each."""
    runs: list[list[BlockPart]] = []
    for p in parts:
        if (runs and len(runs[-1]) < cpu_layout.PROJ_MAX_PARTS
                and x_group(runs[-1][0].block_type) == x_group(p.block_type)):
            runs[-1].append(p)
        else:
            runs.append([p])
    return [tuple(r) for r in runs]


def block_type_of(ggml_type: GT) -> str | None:
    """The block type that runs a GGUF tensor type natively; None for the others."""
    return _BY_GGML.get(ggml_type)


def row_bytes(k: int, block_type: str) -> int:
    f = BLOCK_TYPES[block_type]
    if k % f.block_weights:
        raise ValueError(f"{block_type}: k={k} is not a multiple of {f.block_weights}")
    return k // f.block_weights * f.block_bytes


def packed_nbytes(n: int, k: int, block_type: str) -> int:
    f = BLOCK_TYPES[block_type]
    return -(-n // PANEL) * (k // f.block_weights) * f.group_bytes


# ---- panels ----------------------------------------------------------------------------

def _code_bytes(q32: Tensor, bits: int) -> Tensor:
    """Codes of 32-blocks [P, G32, 16 columns, 32] -> their chunk bytes [P, G32, B]: nibble
    chunks, byte chunks (bits 8) or nibble chunks then bit planes (bits 5, 6)."""
    p, g = q32.shape[0], q32.shape[1]
    lo, hi = q32[..., :16].reshape(p, g, PANEL, 4, 4), q32[..., 16:].reshape(p, g, PANEL, 4, 4)
    if bits == 8:  # [j][lo/hi][column][t]
        chunks = torch.stack((lo.transpose(2, 3), hi.transpose(2, 3)), dim=3)
        return chunks.reshape(p, g, 512)
    nib = ((lo & 0x0F) | ((hi & 0x0F) << 4)).transpose(2, 3).reshape(p, g, 256)  # [j][column][t]
    planes = [nib]
    if bits == 6:  # a plane of bit pairs per half
        for half in (lo, hi):
            pairs = ((half >> 4) & 3).to(torch.int32)
            plane = sum(pairs[:, :, :, j] << (2 * j) for j in range(4))  # [P, G32, column, t]
            planes.append(plane.to(torch.uint8).reshape(p, g, 64))
        return torch.cat(planes, dim=-1)
    for bit in range(4, bits):
        lo_b, hi_b = ((lo >> bit) & 1).to(torch.int32), ((hi >> bit) & 1).to(torch.int32)
        plane = sum((lo_b[:, :, :, j] << (2 * j)) | (hi_b[:, :, :, j] << (2 * j + 1))
                    for j in range(4))  # [P, G32, column, t]
        planes.append(plane.to(torch.uint8).reshape(p, g, 64))
    return torch.cat(planes, dim=-1)


def _codes_from_bytes(raw: Tensor, bits: int) -> Tensor:
    """`_code_bytes` undone: [P, G32, B] -> codes [P, G32, 16 columns, 32]."""
    p, g = raw.shape[0], raw.shape[1]
    if bits == 8:
        c = raw.reshape(p, g, 4, 2, PANEL, 4)  # [j, lo/hi, column, t]
        lo, hi = c[:, :, :, 0].transpose(2, 3), c[:, :, :, 1].transpose(2, 3)  # [col, j, t]
    else:
        nib = raw[..., :256].reshape(p, g, 4, PANEL, 4).transpose(2, 3)  # [column, j, t]
        lo, hi = nib & 0x0F, nib >> 4
        shifts = torch.arange(4, dtype=torch.uint8).view(1, 1, 1, 4, 1) * 2
        if bits == 6:
            pairs = [raw[..., at:at + 64].reshape(p, g, PANEL, 1, 4) for at in (256, 320)]
            lo = lo | (((pairs[0] >> shifts) & 3) << 4)
            hi = hi | (((pairs[1] >> shifts) & 3) << 4)
        for i, bit in enumerate(range(4, bits if bits == 5 else 4)):
            plane = raw[..., 256 + 64 * i: 320 + 64 * i].reshape(p, g, PANEL, 1, 4)
            lo = lo | (((plane >> shifts) & 1) << bit)
            hi = hi | (((plane >> (shifts + 1)) & 1) << bit)
    return torch.cat((lo.reshape(p, g, PANEL, 16), hi.reshape(p, g, PANEL, 16)), dim=-1)


# Per-column fields of a group, in order, with their bytes per column.
_HEADS = {"q4_0": (("d", 2),), "q4_1": (("d", 2), ("m", 2)), "q8_0": (("d", 2),),
          "q4_k": (("d", 2), ("dmin", 2), ("sc", 8), ("mn", 8)),
          "q5_k": (("d", 2), ("dmin", 2), ("sc", 8), ("mn", 8)),
          "q6_k": (("d", 2), ("sc", 16))}


def _to_panels(fields: Fields, f: BlockFormat) -> Tensor:
    """Codes and fields of [n, k] (n a multiple of 16) -> panels [P, groups, group_bytes]."""
    q = fields["q"]
    n, k = q.shape
    p, groups, sub = n // PANEL, k // f.block_weights, f.block_weights // 32
    heads = []
    for name, width in _HEADS[f.name]:
        if name == "mn":  # [pair][column][2]
            v = fields[name].reshape(p, PANEL, groups, 4, 2).permute(0, 2, 3, 1, 4)
        elif width > 2:  # [width][column]
            v = fields[name].reshape(p, PANEL, groups, width).permute(0, 2, 3, 1)
        else:
            v = fields[name].reshape(p, PANEL, groups, 2).permute(0, 2, 1, 3)
        heads.append(v.reshape(p, groups, PANEL * width))
    q32 = q.reshape(p, PANEL, groups * sub, 32).transpose(1, 2)  # [P, G32, column, 32]
    codes = _code_bytes(q32, CODE_BITS[f.name]).reshape(p, groups, -1)
    return torch.cat((*heads, codes), dim=-1)


def _from_panels(panels: Tensor, f: BlockFormat) -> Fields:
    """`_to_panels` undone: [P, groups, group_bytes] -> codes and fields of [16 P, k]."""
    p, groups, _ = panels.shape
    sub, at, fields = f.block_weights // 32, 0, {}
    for name, width in _HEADS[f.name]:
        raw = panels[..., at:at + PANEL * width]
        at += PANEL * width
        if name == "mn":  # [P, groups, pair, column, 2] -> [16 P, groups, 8]
            v = raw.reshape(p, groups, 4, PANEL, 2).permute(0, 3, 1, 2, 4)
        elif width > 2:  # [P, groups, width, column] -> [16 P, groups, width]
            v = raw.reshape(p, groups, width, PANEL).permute(0, 3, 1, 2)
        else:
            v = raw.reshape(p, groups, PANEL, 2).permute(0, 2, 1, 3)
        fields[name] = v.reshape(p * PANEL, groups, width).contiguous()
    codes = _codes_from_bytes(panels[..., at:].reshape(p, groups * sub, -1), CODE_BITS[f.name])
    fields["q"] = codes.transpose(1, 2).reshape(p * PANEL, groups * sub * 32)
    return fields


def _pack_c(blocks: Tensor, f: BlockFormat, k: int, out: Tensor | None) -> Tensor | None:
    """kernels/cpu/pack_blocks.c's packing of `blocks` [n, row_bytes] into `out` (of the
    packed size; allocated when None): the bytes the torch path writes, in one pass per
    panel. None, nothing written, where the kernels are not built or do not take these
    tensors (not uint8 contiguous CPU tensors)."""
    lib = cpu_build.load()
    if lib is None or not (blocks.dtype == torch.uint8 and blocks.device.type == "cpu"
                           and blocks.is_contiguous()):
        return None
    if out is None:
        out = torch.empty(packed_nbytes(blocks.shape[0], k, f.name), dtype=torch.uint8)
    elif not (out.dtype == torch.uint8 and out.device.type == "cpu" and out.is_contiguous()):
        return None
    if blocks.shape[0] and lib.pack_gguf_blocks(out.data_ptr(), blocks.data_ptr(),
                                                blocks.shape[0], k, f.code,
                                                torch.get_num_threads()) != 0:
        return None
    return out


# Rows per step of the torch path (a multiple of PANEL): bounds its transient codes and
# fields, several bytes per weight, to a few MB whatever the tensor's size.
_REFERENCE_ROWS = 256


def _pack_reference(blocks: Tensor, f: BlockFormat) -> Tensor:
    n = blocks.shape[0]
    padded_n = -(-n // PANEL) * PANEL
    if padded_n != n:
        blocks = torch.cat((blocks, blocks.new_zeros(padded_n - n, blocks.shape[1])))
    return _to_panels(file_fields(blocks, f.name), f).reshape(-1)


def pack_blocks(blocks: Tensor, block_type: str, out: Tensor | None = None,
                reference: bool = False) -> Tensor:
    """A file's blocks uint8 [n, row_bytes] -> the packed panels, uint8 1-D of
    packed_nbytes(n, k) (written into `out` when given). Columns past n are zero blocks.
    The C packer (kernels/cpu/pack_blocks.c) writes them where it takes the tensors;
    `reference`, or no kernels, takes the torch path, which defines the bytes. ValueError
    where the rows are not whole blocks or `out` is not packed_nbytes(n, k) long."""
    f = BLOCK_TYPES[block_type]
    n, width = blocks.shape
    if width == 0 or width % f.block_bytes:
        raise ValueError(f"{block_type}: rows of {width} bytes are not whole "
                         f"{f.block_bytes}-byte blocks")
    k = width // f.block_bytes * f.block_weights
    nbytes = packed_nbytes(n, k, block_type)
    if out is not None and out.numel() != nbytes:
        raise ValueError(f"{block_type} [{n}, {k}] packs to {nbytes} bytes, not "
                         f"out's {out.numel()}")
    if not reference:
        packed = _pack_c(blocks, f, k, out)
        if packed is not None:
            return packed
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    step = packed_nbytes(_REFERENCE_ROWS, k, block_type)
    for i, first in enumerate(range(0, n, _REFERENCE_ROWS)):
        panels = _pack_reference(blocks[first:first + _REFERENCE_ROWS], f)
        out[i * step:i * step + panels.numel()].copy_(panels)
    return out


def unpack_blocks(packed: Tensor, block_type: str, n: int, k: int) -> Tensor:
    """`pack_blocks` undone: the file's blocks [n, row_bytes] (a copy)."""
    f = BLOCK_TYPES[block_type]
    panels = packed.reshape(-(-n // PANEL), k // f.block_weights, f.group_bytes)
    return file_blocks(_from_panels(panels, f), f.name)[:n].contiguous()


def dequantize_blocks(blocks: Tensor, block_type: str) -> Tensor:
    """A file's blocks [n, row_bytes] -> float32 [n, k], as the gguf package dequantizes."""
    f = BLOCK_TYPES[block_type]
    data = gguf_dequantize(blocks.contiguous().numpy(), f.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))


# ---- a weight of parts ------------------------------------------------------------------

@dataclass(frozen=True)
class BlockPart:
    block_type: str
    rows: int
    offset: int  # into the weight's uint8 buffer
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """A weight [n, k] held as parts of block types, in output-row order, packed back to
    back in one uint8 buffer; every part but the last has rows % 16 == 0."""
    parts: tuple[BlockPart, ...]
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def storage(self) -> str:
        """"q4_k", or "mixed:q4_k+q6_k" for parts of several types."""
        names = sorted({p.block_type for p in self.parts})
        return names[0] if len(names) == 1 else "mixed:" + "+".join(names)


def layout_for(parts: Sequence[tuple[str, int]], k: int) -> BlockLayout:
    """[(block_type, rows), ...] of a weight with k inputs -> its BlockLayout. ValueError
    where a part other than the last has rows that are not a multiple of 16, or k does not
    divide into the type's blocks."""
    out, offset = [], 0
    for i, (block_type, rows) in enumerate(parts):
        if block_type not in BLOCK_TYPES:
            raise ValueError(f"unknown block type {block_type!r}")
        if i + 1 < len(parts) and rows % PANEL:
            raise ValueError(f"part {i} of a block weight has {rows} rows, not a multiple "
                             f"of {PANEL}")
        row_bytes(k, block_type)  # k divides into its blocks
        nbytes = packed_nbytes(rows, k, block_type)
        out.append(BlockPart(block_type, rows, offset, nbytes))
        offset += nbytes
    return BlockLayout(tuple(out), sum(r for _, r in parts), k)


def _part_data(data: Tensor, part: BlockPart) -> Tensor:
    return data[part.offset:part.offset + part.nbytes]


def dequantize_weight(data: Tensor, layout: BlockLayout) -> Tensor:
    """The whole weight (or the parts `layout` names) as float32 [n, k] (a transient copy:
    the reference path)."""
    return torch.cat([dequantize_blocks(unpack_blocks(_part_data(data, p), p.block_type,
                                                      p.rows, layout.k), p.block_type)
                      for p in layout.parts])


def gather_rows(data: Tensor, layout: BlockLayout, rows: Tensor) -> Tensor:
    """Rows `rows` [T] (int64) of the weight as float32 [T, k]: the embedding lookup of a
    block-stored table. Each row's panel is unpacked (16 rows) and the row dequantized."""
    out = torch.empty(rows.shape[0], layout.k)
    start = 0
    for p in layout.parts:
        mine = (rows >= start) & (rows < start + p.rows)
        if bool(mine.any()):
            local = rows[mine] - start
            f = BLOCK_TYPES[p.block_type]
            groups = layout.k // f.block_weights
            panels = _part_data(data, p).view(-1, groups, f.group_bytes)[local // PANEL]
            blocks = file_blocks(_from_panels(panels, f), f.name)  # [T * 16, row_bytes]
            picked = blocks.view(-1, PANEL, blocks.shape[1])[torch.arange(local.shape[0]),
                                                             local % PANEL]
            out[mine] = dequantize_blocks(picked, p.block_type)
        start += p.rows
    return out


def reference_linear(x: Tensor, data: Tensor, layout: BlockLayout,
                     bias: Tensor | None = None) -> Tensor:
    """The torch path (no kernels built): x quantized per group (`x_group`) and back, the
    weights dequantized for this call: the GEMM's arithmetic up to float32 rounding."""
    rows = x.reshape(-1, layout.k).float()
    out = torch.cat([torch.nn.functional.linear(
        quantize_dequantize_blocks(rows, x_group(run[0].block_type)),
        dequantize_weight(data, BlockLayout(run, sum(p.rows for p in run), layout.k)))
        for run in x_runs(layout.parts)], dim=1)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], layout.n)


def _gemm_supported(x: Tensor, data: Tensor, layout: BlockLayout, lib: object) -> bool:
    return (lib is not None and x.dim() == 2 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous() and x.shape[1] == layout.k
            and data.dtype == torch.uint8 and data.is_contiguous()
            and data.numel() >= layout.nbytes)


def gemm(x: Tensor, data: Tensor, layout: BlockLayout,
         bias: Tensor | None = None) -> Tensor | None:
    """x [M, k] float32 @ W^T (+ bias [n]) -> [M, n] float32 for any M, W block-packed as
    `layout` says (x quantized to int8 by the kernel, once per run of parts that read it
    alike, `x_runs`: each part written into its columns); None (nothing computed) where the
    kernels are not built or do not take it, so the caller takes reference_linear."""
    lib = cpu_build.load()
    if not _gemm_supported(x, data, layout, lib):
        return None
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()
                                 and bias.shape == (layout.n,)):
        return None
    m = x.shape[0]
    out = x.new_empty((m, layout.n))
    if m == 0:
        return out
    # One call per run of parts (a weight of several runs, a fused projection mixing
    # K-quants and other types or of more than PROJ_MAX_PARTS parts, writes each run into
    # a temporary).
    runs, col = x_runs(layout.parts), 0
    for run in runs:
        rows = sum(p.rows for p in run)
        y = out if len(runs) == 1 else x.new_empty((m, rows))
        w = cpu_layout.ProjWeight(num_parts=len(run))
        for slot, p in zip(w.parts, run):
            slot.data, slot.rows = data.data_ptr() + p.offset, p.rows
            slot.fmt = BLOCK_TYPES[p.block_type].code
        b = None if bias is None else bias[col:col + rows]
        rc = lib.packed_gemm_parts(y.data_ptr(), x.data_ptr(), ctypes.byref(w),
                                   None if b is None else b.data_ptr(), m, rows, layout.k,
                                   torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"gemm: the kernel does not read parts {run}")
        if rc != 0:
            raise MemoryError("gemm: out of memory")
        if y is not out:
            out[:, col:col + rows] = y
        col += rows
    return out
