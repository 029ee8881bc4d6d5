"""reshape_and_cache (vLLM's name): the step's new K/V into the paged cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """Grid (T, Hkv): a program copies K and V of one token and one KV head to
    cache[0 / 1, slot // BLOCK_SIZE, slot % BLOCK_SIZE, head], cast to the cache's dtype.
    Slot -1 (padding) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    dims = tl.arange(0, HEAD_PAD)
    mask = dims < HEAD_DIM
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
           + head * stride_ch + dims)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """k/v [>= T, Hkv, D] (any row/head strides) -> kv_cache [2, blocks, block_size, Hkv, D]
    at slot_mapping [T] (int64, slot = block * block_size + offset; -1 = skip)."""
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape[1:] != k.shape[1:]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache "
                         f"{tuple(kv_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("k, v and kv_cache need a contiguous last dimension")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache_ref(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """The spec in torch: index_copy_ of the rows whose slot is >= 0."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    n = slot_mapping.shape[0]
    for i, new in enumerate((k, v)):
        kv_cache[i].view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, new[:n][keep].to(kv_cache.dtype))
