"""Multi-LoRA shrink / expand (punica's, vLLM's names) over the engine's slot layout
(aioengine.lora.layers), with rows grouped by adapter slot so each program reads one
slot's weights once for a block of its tokens:

    x [T, K], token_slots [T] int32 (-1 = base model)
    lora_a [L, S, R, K]   A of each of the S slices (qkv: 3, gate_up: 2)
    lora_b [L, R, N]      B transposed; slice s owns columns offsets[s] .. + sizes[s]
    ranks  [L, S] int32   rank of each slot's slice (0: not targeted)

    shrink: u[s, t, j] = lora_a[slot_t, s, j] . x[t]          (j < rank, else 0)
    expand: y[t, off_s + n] += sum_j u[s, t, j] lora_b[slot_t, j, off_s + n]

`lora_token_groups` sorts the tokens by slot on the device (no host sync); the kernels'
grids are upper bounds from shapes, and a program whose slot has fewer tokens exits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


def lora_token_groups(token_slots: Tensor, num_slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order [T], counts [L], starts [L]) int32: token indices sorted by slot, and where
    each slot's tokens start in `order` and how many there are (slot -1 is left out)."""
    slots = token_slots.long()
    order = torch.argsort(slots, stable=True)
    ids = torch.arange(num_slots, device=slots.device)
    counts = (slots[None, :] == ids[:, None]).sum(1)
    starts = (slots < 0).sum() + torch.cumsum(counts, 0) - counts
    return order.to(torch.int32), counts.to(torch.int32), starts.to(torch.int32)


@triton.jit
def _slot_tile(order_ptr, starts_ptr, lora, m_block, count, rank, BLOCK_M: tl.constexpr,
               RANK_PAD: tl.constexpr):
    """Block m_block of slot `lora`'s tokens: their rows in x/y (int64) and which are real,
    and the rank lanes and which are below the slot's rank."""
    idx = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = idx < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + lora) + idx, mask=row_ok, other=0).to(tl.int64)
    j = tl.arange(0, RANK_PAD)
    return rows, row_ok, j, j < rank


@triton.jit
def _lora_shrink_kernel(
    u_ptr, x_ptr, a_ptr, ranks_ptr, order_ptr, counts_ptr, starts_ptr,
    k_dim, stride_xt, stride_al, stride_as, stride_ar, stride_us, stride_ut,
    NUM_SLICES: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), S, L): u rows of BLOCK_M tokens of slot l, slice s,
    all ranks at once, over K in BLOCK_K steps (fp32 accumulation)."""
    m_block = tl.program_id(0)
    s = tl.program_id(1)
    lora = tl.program_id(2)
    count = tl.load(counts_ptr + lora)
    rank = tl.load(ranks_ptr + lora * NUM_SLICES + s)
    if m_block * BLOCK_M >= count or rank == 0:
        return
    rows, row_ok, j, j_ok = _slot_tile(order_ptr, starts_ptr, lora, m_block, count, rank,
                                       BLOCK_M, RANK_PAD)
    a_base = a_ptr + lora.to(tl.int64) * stride_al + s * stride_as
    acc = tl.zeros([BLOCK_M, RANK_PAD], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_base + j[None, :] * stride_ar + ks[:, None],
                    mask=k_ok[:, None] & j_ok[None, :], other=0.0)  # [BLOCK_K, RANK_PAD]
        acc += tl.dot(x.to(a.dtype), a, input_precision=DOT_PRECISION)
    tl.store(u_ptr + s * stride_us + rows[:, None] * stride_ut + j[None, :], acc,
             mask=row_ok[:, None] & j_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr, u_ptr, b_ptr, ranks_ptr, order_ptr, counts_ptr, starts_ptr, offsets_ptr, sizes_ptr,
    stride_yt, stride_bl, stride_br, stride_us, stride_ut,
    NUM_SLICES: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), S * cdiv(max slice, BLOCK_N), L): y[rows, cols] += u @ B for
    BLOCK_M tokens of slot l and BLOCK_N columns of one slice. Programs write disjoint
    (row, column) tiles, so no atomics."""
    m_block = tl.program_id(0)
    lora = tl.program_id(2)
    s = tl.program_id(1) % NUM_SLICES
    n_block = tl.program_id(1) // NUM_SLICES
    count = tl.load(counts_ptr + lora)
    rank = tl.load(ranks_ptr + lora * NUM_SLICES + s)
    size = tl.load(sizes_ptr + s)
    if m_block * BLOCK_M >= count or rank == 0 or n_block * BLOCK_N >= size:
        return
    rows, row_ok, j, j_ok = _slot_tile(order_ptr, starts_ptr, lora, m_block, count, rank,
                                       BLOCK_M, RANK_PAD)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < size
    cols = tl.load(offsets_ptr + s) + n
    u = tl.load(u_ptr + s * stride_us + rows[:, None] * stride_ut + j[None, :],
                mask=row_ok[:, None] & j_ok[None, :], other=0.0)
    b = tl.load(b_ptr + lora.to(tl.int64) * stride_bl + j[:, None] * stride_br + cols[None, :],
                mask=j_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.dot(u.to(b.dtype), b, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    y = tl.load(y_ptrs, mask=mask)
    tl.store(y_ptrs, y + delta.to(y.dtype), mask=mask)


def _rank_pad(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, token_slots: Tensor,
                groups: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """u [S, T, R] float32 (see the module docstring). `groups`: lora_token_groups of
    token_slots, shared by every projection of a step (computed here when None)."""
    num_tokens, k_dim = x.shape
    num_slots, num_slices, max_rank, _ = lora_a.shape
    if lora_a.shape[3] != k_dim or x.stride(-1) != 1 or lora_a.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not fit lora_a {tuple(lora_a.shape)}")
    u = torch.zeros((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return u
    order, counts, starts = groups or lora_token_groups(token_slots, num_slots)
    grid = (triton.cdiv(num_tokens, BLOCK_M), num_slices, num_slots)
    _lora_shrink_kernel[grid](
        u, x, lora_a, ranks.to(x.device).contiguous(), order, counts, starts, k_dim,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), u.stride(0), u.stride(1),
        NUM_SLICES=num_slices, RANK_PAD=_rank_pad(max_rank), BLOCK_M=BLOCK_M,
        BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(k_dim))),
        DOT_PRECISION=_precision(lora_a.dtype))
    return u


def lora_expand(y: Tensor, u: Tensor, lora_b: Tensor, ranks: Tensor, token_slots: Tensor,
                slice_sizes: tuple[int, ...],
                groups: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """y [T, N] += each token's u [S, T, R] @ its slot's B, slice by slice, in place."""
    num_tokens = y.shape[0]
    num_slots, max_rank, n_dim = lora_b.shape
    if sum(slice_sizes) != n_dim or y.shape[1] != n_dim or u.shape[0] != len(slice_sizes):
        raise ValueError(f"slices {slice_sizes}, y {tuple(y.shape)}, u {tuple(u.shape)} do not "
                         f"fit lora_b {tuple(lora_b.shape)}")
    if y.stride(-1) != 1 or lora_b.stride(-1) != 1 or u.stride(-1) != 1:
        raise ValueError("y, u and lora_b need a contiguous last dimension")
    if num_tokens == 0:
        return y
    order, counts, starts = groups or lora_token_groups(token_slots, num_slots)
    offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=y.device)
    sizes_t = torch.tensor(slice_sizes, dtype=torch.int32, device=y.device)
    block_n = min(BLOCK_N, max(16, triton.next_power_of_2(max(slice_sizes))))
    grid = (triton.cdiv(num_tokens, BLOCK_M),
            len(slice_sizes) * triton.cdiv(max(slice_sizes), block_n), num_slots)
    _lora_expand_kernel[grid](
        y, u, lora_b, ranks.to(y.device).contiguous(), order, counts, starts, offsets_t, sizes_t,
        y.stride(0), lora_b.stride(0), lora_b.stride(1), u.stride(0), u.stride(1),
        NUM_SLICES=len(slice_sizes), RANK_PAD=_rank_pad(max_rank), BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, DOT_PRECISION=_precision(lora_b.dtype))
    return y


def lora_shrink_ref(x: Tensor, lora_a: Tensor, ranks: Tensor, token_slots: Tensor) -> Tensor:
    """The spec of lora_shrink in torch (fp32, one token at a time)."""
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    u = torch.zeros((num_slices, x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s in range(num_slices):
            r = int(ranks[slot, s])
            u[s, t, :r] = lora_a[slot, s, :r].float() @ x[t].float()
    return u


def lora_expand_ref(y: Tensor, u: Tensor, lora_b: Tensor, ranks: Tensor, token_slots: Tensor,
                    slice_sizes: tuple[int, ...]) -> Tensor:
    """The spec of lora_expand in torch (fp32 products, added in y's dtype), in place."""
    offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s, (off, n) in enumerate(zip(offsets, slice_sizes)):
            r = int(ranks[slot, s])
            if r:
                delta = u[s, t, :r] @ lora_b[slot, :r, off:off + n].float()
                y[t, off:off + n] += delta.to(y.dtype)
    return y
