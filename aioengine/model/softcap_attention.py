"""Paged attention with soft-capped scores (Gemma 2: scores = cap * tanh(scores / cap) before
the softmax), which SDPA and the C kernel do not take: the layer code runs it itself, in
torch, on any device (correct, not fast: one request at a time, scores materialised).

Same contract as `AttentionBackend.forward`: the step's K/V are written to the paged cache
first (a request may read blocks another wrote in this step), then each query attends to
its request's positions up to its own (the last `sliding_window` of them); blocks wholly
before a request's first window are not read (they may have been released).
"""
from __future__ import annotations

import torch
from torch import Tensor

from aioengine.model.attention import AttentionMetadata, write_to_kv_cache


def softcap_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None,
                      softcap: float) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D] -> [T, Hq, D]."""
    num_tokens = meta.num_actual_tokens
    write_to_kv_cache(k[:num_tokens], v[:num_tokens], kv_cache, meta.slot_mapping)
    out = torch.zeros_like(q)
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        if end > start:
            out[start:end] = _request(q[start:end], kv_cache, meta.block_tables[i],
                                      meta.seq_lens_cpu[i], scale, sliding_window, softcap)
    return out


def _request(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_len: int, scale: float,
             window: int | None, softcap: float) -> Tensor:
    query_len, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    context_len = seq_len - query_len
    first = 0 if window is None else max(0, (context_len - window + 1) // block_size)
    table = block_table[first:-(-seq_len // block_size)]
    begin = first * block_size
    keys = kv_cache[0][table].reshape(-1, num_kv_heads, head_dim)[:seq_len - begin]
    values = kv_cache[1][table].reshape(-1, num_kv_heads, head_dim)[:seq_len - begin]
    group = num_heads // num_kv_heads
    keys = keys.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    values = values.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, Tq, L]
    scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(begin, seq_len, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)  # [Tq, Hq, D]
