"""The grouped mixture-of-experts MLP on the GPU (the idea of vLLM's fused_moe, our code):

    x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]
    weights, ids [T, k]   the router's top-k (aioengine.model.moe.route)

    y[t] = sum_j weights[t, j] * w2[e] (silu(gate_e x[t]) * up_e x[t]),  e = ids[t, j]

The T * k (token, slot) pairs are sorted by expert and each expert's run padded to a
multiple of BLOCK_M (`moe_align`, on the device, no host sync: the grids are upper bounds
from shapes and programs past the end exit). Each program of `_moe_gemm_kernel` computes
BLOCK_M pairs of ONE expert x BLOCK_N output columns, so an expert's weight tile is read
once for a whole block of its tokens; experts with no pair own no block. Two launches:
gate_up over x's rows, then down over the pairs' activations, times the routing weight;
the k rows of a token are summed in slot order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from aioengine.kernels.triton.activation import silu_and_mul

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def moe_align(ids: Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[Tensor, Tensor]:
    """(pairs [P], block_expert [P / block_m]) int32, P = T k + E (block_m - 1) rounded up
    to block_m: the pair indices t * k + j sorted by expert, each expert's run starting on
    a block boundary, padding = T k (no pair); the expert of each block, E past the last."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts_sorted = torch.cumsum(counts, 0) - counts  # where each expert begins in `order`
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - starts_sorted[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    size = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((size,), num_pairs, dtype=torch.int32, device=ids.device)
    pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return pairs, block_expert


@triton.jit
def _moe_gemm_kernel(
    out_ptr, a_ptr, w_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    num_pairs, num_experts, n_dim, k_dim, top_k,
    stride_at, stride_we, stride_wn, stride_ot,
    ROWS_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (P / BLOCK_M, cdiv(N, BLOCK_N)): out[pair, cols] = a[row] . w[e, cols] for the
    block's BLOCK_M pairs (row = pair // top_k over x, or the pair itself over per-pair
    activations with ROWS_PER_PAIR), times the pair's routing weight with MUL_WEIGHT."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs < num_pairs
    rows = pairs if ROWS_PER_PAIR else pairs // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_dim
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        a = tl.load(a_ptr + rows[:, None] * stride_at + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a.to(w.dtype), w, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def _moe_gemm(a: Tensor, w: Tensor, pairs: Tensor, block_expert: Tensor, num_pairs: int,
              top_k: int, weights: Tensor | None, rows_per_pair: bool) -> Tensor:
    """[num_pairs, N] in a's dtype: each pair's row of `a` times its expert's w [E, N, K]."""
    num_experts, n, k = w.shape
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](
        out, a, w, pairs, block_expert, weights if weights is not None else pairs,
        num_pairs, num_experts, n, k, top_k, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), ROWS_PER_PAIR=rows_per_pair, MUL_WEIGHT=weights is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32")
    return out


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """y [T, H] in x's dtype (see the module docstring); x, w13, w2 contiguous, one dtype."""
    t, top_k = ids.shape
    num_pairs = t * top_k
    pairs, block_expert = moe_align(ids, w13.shape[0])
    gate_up = _moe_gemm(x, w13, pairs, block_expert, num_pairs, top_k, None, False)
    act = silu_and_mul(gate_up)
    pair_weights = weights.reshape(-1).float().contiguous()
    out = _moe_gemm(act, w2, pairs, block_expert, num_pairs, top_k, pair_weights, True)
    return out.view(t, top_k, -1).float().sum(1).to(x.dtype)


def fused_moe_ref(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """The plain-torch spec: token by token, slot by slot, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)
