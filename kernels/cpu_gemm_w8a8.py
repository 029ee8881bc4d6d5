"""W8A8 weights in the any-M GEMM's panels (`kernels/cpu/gemm_w8a8.h`, format GEMM_W8A8P).

An int8 weight [N, K] (per-row scales kept beside it, as before) is repacked once at load
into int8 [ceil(N / 16), 1 + ceil(K / 4), 64]: per panel of 16 output columns, first the
columns' int32 weight sums (64 bytes: the kernel's VNNI build feeds x in as q + 128 and
takes 128 * the sum back), then per group of 4 k the 16 columns' 4 bytes each (k past K
and columns past N are zeros). The same bytes as the row-major weight plus 4 per column:
resident memory stays ~1.0x. `cpu_gemm.gemm` computes with it for any number of rows,
exactly `layers._w8a8_linear`'s bits (x quantized per row, exact integer sums, then
(acc * s_x) * s_w (+ bias)).
"""
from __future__ import annotations

import torch
from torch import Tensor

PANEL = 16
GROUP = 4  # k per 32-bit lane
GROUP_BYTES = PANEL * GROUP


def packed_shape(n: int, k: int) -> tuple[int, int, int]:
    return -(-n // PANEL), 1 + -(-k // GROUP), GROUP_BYTES


def is_w8a8_panels(packed: Tensor) -> bool:
    """Whether a packed tensor is W8A8 panels (int8 groups of 64 bytes; the weight-only int8
    panels are [P, K, 16])."""
    return packed.dtype == torch.int8 and packed.dim() == 3 and packed.shape[2] == GROUP_BYTES


def pack_w8a8(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """int8 weight [N, K] -> [ceil(N / 16), 1 + ceil(K / 4), 64] (into `out` when given)."""
    n, k = weight.shape
    panels, groups1, _ = packed_shape(n, k)
    padded = torch.zeros(panels * PANEL, (groups1 - 1) * GROUP, dtype=torch.int8)
    padded[:n, :k] = weight
    cols = padded.view(panels, PANEL, groups1 - 1, GROUP).transpose(1, 2)  # [P, g, 16, 4]
    sums = padded.sum(dim=1, dtype=torch.int32).view(panels, 1, PANEL)
    packed = torch.cat((sums.view(torch.int8).view(panels, 1, GROUP_BYTES),
                        cols.reshape(panels, groups1 - 1, GROUP_BYTES)), dim=1)
    if out is None:
        return packed
    return out.copy_(packed)


def unpack_w8a8(packed: Tensor, n: int, k: int) -> Tensor:
    """The row-major int8 [n, k] weight back from its panels (a copy)."""
    panels, groups1, _ = packed.shape
    cols = packed[:, 1:].reshape(panels, groups1 - 1, PANEL, GROUP).transpose(1, 2)
    return cols.reshape(panels * PANEL, (groups1 - 1) * GROUP)[:n, :k].contiguous()


def w8a8_rows(packed: Tensor, rows: Tensor, k: int) -> Tensor:
    """Rows `rows` [T] of the weight as int8 [T, k], gathered from the panels (the embedding
    lookup of a tied table)."""
    groups = packed.shape[1] - 1
    col = (rows % PANEL).view(-1, 1, 1)
    g = packed[rows // PANEL, 1:].view(-1, groups, PANEL, GROUP)  # [T, g, 16, 4]
    picked = g.gather(2, col.view(-1, 1, 1, 1).expand(-1, groups, 1, GROUP))
    return picked.reshape(-1, groups * GROUP)[:, :k]
