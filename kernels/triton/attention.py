"""Unified paged attention (vLLM's name): prefill chunks and decodes in one launch.

Layout (aioengine.model.attention): q/out [T, Hq, D] flattened over requests;
query_start_loc [B+1] int32; seq_lens [B] int32 (context including this step's tokens);
block_tables [B, max_blocks] int32; kv_cache [2, num_blocks, block_size, Hkv, D] (0 = K).
Query token i of a request with query_len q and seq_len s sits at position s - q + i and
sees the positions <= its own.

A program owns one "q block" of a request (BLOCK_Q consecutive query tokens) and one KV
head: its BLOCK_M = BLOCK_Q * group rows are every (token, query head of the group) pair,
so GQA reads each K/V tile once for all the heads that share it. Grid axis 0 runs over
T // BLOCK_Q + B q blocks, an upper bound needing no device data (the spare programs
exit); a program finds its request by binary search over query_start_loc.

Split-KV: with num_segments > 1 each program also takes one segment of the keys and writes
an unnormalised partial (acc, running max, running sum) instead of out; a second kernel
combines the segments. It gives decode steps of few sequences more programs to run.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 16  # rows per program (tl.dot needs >= 16); more when a KV group is larger
MIN_TILE = 32  # keys per inner-loop iteration (at least one KV block)
NUM_SEGMENTS = 16  # split-KV segments per sequence
SPLIT_KV_MIN_SEQ_LEN = 512  # shorter decodes gain nothing from splitting


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale, num_seqs, num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (T // BLOCK_Q + B, Hkv, NUM_SEGMENTS). Online softmax in fp32 over the keys
    of one request (one segment of them when NUM_SEGMENTS > 1) for one q block and one
    KV head. Keys are gathered per position through the block table, so any block size
    works and only positions < seq_len are ever loaded (unused blocks are never read)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    # Binary search for the request owning this q block: the last i whose first block,
    # query_start_loc[i] // BLOCK_Q + i, is <= q_block.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // GROUP  # token inside the request
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < query_len)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys up to the last query of this block; with split-KV, this segment's share.
    last_q = tl.minimum((local_block + 1) * BLOCK_Q, query_len)
    num_tiles = (context_len + last_q + TILE - 1) // TILE
    if NUM_SEGMENTS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        per_segment = ((seq_len + TILE - 1) // TILE + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        tile_lo = segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    cols = tl.arange(0, TILE)
    head_base = cache_ptr + kv_head.to(tl.int64) * stride_ch
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE + cols
        key_ok = key_pos < seq_len
        block = tl.load(block_tables_ptr + seq * stride_bt + key_pos // BLOCK_SIZE,
                        mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(head_base + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(head_base + stride_kv + slot[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale
        visible = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (token * num_q_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_ok[:, None])  # all HEAD_PAD columns: the reduce reads them all
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, num_seqs,
    num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid (T, cdiv(Hq, BLOCK_H)): out[t, h] for BLOCK_H heads of token t from their
    NUM_SEGMENTS partials. Segments that saw no key have max -inf and weigh 0; segment 0
    always holds key 0, which every query sees. Rows past query_start_loc[B] (padding)
    are left alone."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    head_ok = heads < num_q_heads
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_PAD)
    part = (token * num_q_heads + heads)[:, None] * NUM_SEGMENTS + segs[None, :]  # [H, S]
    m = tl.load(part_max_ptr + part, mask=head_ok[:, None], other=0.0)
    weight = tl.exp(m - tl.max(m, 1)[:, None])
    total = tl.sum(tl.load(part_sum_ptr + part, mask=head_ok[:, None], other=1.0) * weight, 1)
    acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_PAD + dims[None, None, :],
                  mask=head_ok[:, None, None], other=0.0)  # [H, S, D]
    out = tl.sum(acc * weight[:, :, None], 1) / total[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (dims < HEAD_DIM)[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products, not TF32, so fp32 matches the torch backend.
    return "ieee" if dtype == torch.float32 else "tf32"


def unified_attention(q: Tensor, kv_cache: Tensor, out: Tensor, query_start_loc: Tensor,
                      seq_lens: Tensor, block_tables: Tensor, scale: float,
                      num_segments: int = 1) -> Tensor:
    """out[t, h] = causal paged attention of q[t, h] over its request's cached K/V (the
    step's own K/V must already be in the cache). Returns out. num_segments > 1 takes the
    split-KV path (a power of two). No device-to-host sync: the grid comes from shapes."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_q_heads % num_kv_heads or kv_cache.shape[-1] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q, out and kv_cache need a contiguous last dimension")
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    head_pad = triton.next_power_of_2(head_dim)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        part_acc = torch.empty((num_tokens, num_q_heads, num_segments, head_pad),
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_tokens, num_q_heads, num_segments), dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    _unified_attention_kernel[grid](
        out, q, kv_cache, block_tables, seq_lens, query_start_loc,
        part_acc, part_max, part_sum,
        scale, num_seqs, num_q_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        TILE=max(MIN_TILE, block_size), BLOCK_M=block_m, BLOCK_Q=block_q,
        NUM_SEGMENTS=num_segments, DOT_PRECISION=_dot_precision(q.dtype),
    )
    if num_segments > 1:
        # ~4096 partial values per program, at most every head of the token.
        block_h = min(triton.next_power_of_2(num_q_heads),
                      max(1, 4096 // (num_segments * head_pad)))
        _reduce_segments_kernel[(num_tokens, triton.cdiv(num_q_heads, block_h))](
            out, part_acc, part_max, part_sum, query_start_loc, num_seqs, num_q_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SEGMENTS=num_segments, BLOCK_H=block_h,
        )
    return out


def split_kv_segments(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_sms: int) -> int:
    """How many KV segments a step should use (1 = no split): split decode-only steps
    whose programs (sequences x KV heads) leave most SMs idle and whose contexts are long
    enough for every segment to get work."""
    if max_query_len != 1 or max_seq_len < SPLIT_KV_MIN_SEQ_LEN:
        return 1
    if num_seqs * num_kv_heads * 2 > num_sms:
        return 1
    return NUM_SEGMENTS


def unified_attention_ref(q: Tensor, kv_cache: Tensor, out: Tensor, query_start_loc: Tensor,
                          seq_lens: Tensor, block_tables: Tensor, scale: float,
                          num_segments: int = 1) -> Tensor:
    """The spec of unified_attention in plain torch, fp32, one request at a time
    (num_segments does not change the result)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        blocks = block_tables[i, :math.ceil(seq_len / block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [S, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
