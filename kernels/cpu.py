"""CPU kernels written in C (`kernels/cpu/`), each wrapper here checking what its kernel
takes and returning False / None, having done nothing, where it does not apply or the
kernels are not built (the caller keeps its torch path). Building, the per-instruction-set
builds and their run-time choice live in `cpu_build.py`; called through ctypes, which
releases the GIL.

Only what torch has no fast path for lives here, each file in `kernels/cpu/` explaining its
kernel: paged attention of decode and prefill rows, which would otherwise gather every
request's K/V blocks into a padded copy on each layer, split at fixed absolute positions so
a token's bits do not depend on how its step was formed; and, in place of several small allocating torch ops per layer,
rotary embedding in place, the K/V cache write (reshape_and_cache), RMSNorm with the residual
add fused in, and SiLU-and-mul. The projections run on weights packed at load, by the any-M
GEMM (`cpu_gemm.py`; there is no row-major kernel: an unpacked weight takes the torch path),
and for decode steps all decoder layers in one call (`llama_decode`, in `cpu_decode.py` with
the LoRA kernels), which removes the per-layer Python work that otherwise costs a fifth of
the step.
"""
from __future__ import annotations


import torch
from torch import Tensor

from aioengine.kernels.cpu_layout import LORA_TABLE_WIDTH
from aioengine.kernels.cpu_build import (BASELINE_VARIANT, ISA_VARIANTS, amx_mode, load,
                                         load_error, reset, set_amx_mode, supported_variants,
                                         use_variant, variant)

__all__ = ["BASELINE_VARIANT", "ISA_VARIANTS", "LORA_TABLE_WIDTH", "amx_mode", "describe",
           "load", "load_error", "reset", "set_amx_mode", "supported_variants", "use_variant",
           "variant"]


def describe() -> str | None:
    """The loaded build and where its bf16 GEMM runs, for logs and /version: "amx (bf16
    GEMM on AMX tiles)", "avx2"; None when no build is loaded."""
    name = variant()
    where = {"tiles": "AMX tiles", "emulated": "emulated AMX tiles"}.get(amx_mode() or "")
    if name is None or where is None:
        return name
    return f"{name} (bf16 GEMM on {where})"


# The K/V cache element types the C attention reads (bf16 widened to float32 as read).
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _f32_rows(*tensors: Tensor) -> bool:
    """Every tensor float32 on the CPU and contiguous."""
    for t in tensors:  # a plain loop: a generator here cost ~1 us per call
        if not (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()):
            return False
    return True


def paged_attention(out: Tensor, q: Tensor, kv_cache: Tensor, block_tables: Tensor,
                    row_to_req: Tensor, seq_lens: Tensor, scale: float,
                    num_threads: int | None = None, sliding_window: int | None = None) -> bool:
    """out[r] = softmax(q[r] K^T * scale) V over positions 0 .. seq_lens[r] - 1 of request
    row_to_req[r] (the last `sliding_window` of them: table entries before those are never
    read): decode rows and prefill rows (row j of a chunk after context_len cached
    positions: seq_len context_len + j + 1) in one call, K/V read in place from the cache.

    Every row is split at fixed absolute positions and its parts combined in order
    (kernels/cpu/attention.h), so a row's bits depend only on its query, the cache and its
    seq_len: not on the other rows, the chunking, the prefix cache or num_threads.

    out/q [R, Hq, D] float32, kv_cache [2, blocks, block_size, Hkv, D] float32 or bfloat16
    (KV_CACHE_DTYPES: bf16 values widened exactly to float32 as read), block_tables
    [N, max_blocks] int32, row_to_req/seq_lens [R] int32, all contiguous on the CPU.
    Raises ValueError for a row_to_req outside [0, N) or a seq_len outside
    [1, max_blocks * block_size]. Returns False, leaving `out` untouched, when the kernel
    does not apply or is not built.
    """
    num_rows = q.shape[0] if q.dim() == 3 else -1
    if not (num_rows >= 0 and _f32_rows(out, q) and kv_cache.dtype in KV_CACHE_DTYPES
            and kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
            and out.shape == q.shape
            and kv_cache.dim() == 5 and q.shape[2] == kv_cache.shape[4]
            and q.shape[1] % kv_cache.shape[3] == 0 and block_tables.dim() == 2
            and block_tables.dtype == row_to_req.dtype == seq_lens.dtype == torch.int32
            and block_tables.is_contiguous() and row_to_req.is_contiguous()
            and seq_lens.is_contiguous() and row_to_req.shape == seq_lens.shape == (num_rows,)
            and block_tables.device.type == row_to_req.device.type == "cpu"
            and seq_lens.device.type == "cpu"):
        return False
    lib = load()
    if lib is None:
        return False
    _, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    rc = lib.paged_attention_f32(
        out.data_ptr(), q.data_ptr(), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16),
        num_blocks, block_tables.data_ptr(),
        block_tables.shape[1], block_tables.shape[0], row_to_req.data_ptr(),
        seq_lens.data_ptr(), num_rows, num_heads, num_kv_heads, head_dim, block_size,
        sliding_window or 0, scale,
        torch.get_num_threads() if num_threads is None else num_threads)
    if rc == -2:
        raise ValueError("paged_attention: a row_to_req outside the block tables or a seq_len "
                         "outside [1, table width * block_size]")
    if rc != 0:
        raise MemoryError("paged_attention: out of memory for its part buffers")
    return True


def rotary_embedding(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Rotates x [T, H, D] in place (neox style: pairs (i, i + D/2)) by the angles of
    `positions` [T] (int64), reading cos/sin tables [max_positions, D/2].

    x float32 on the CPU with contiguous heads (any token stride: q and k heads inside a
    fused qkv output qualify); tables float32 and contiguous. Positions must be in range
    (the caller's invariant: they come from the scheduler). Returns False, leaving x
    untouched, when the kernel does not apply or is not built.
    """
    num_tokens, num_heads, head_dim = x.shape
    if not (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and x.stride(2) == 1 and x.stride(1) == head_dim
            and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape[-1] * 2 == head_dim and positions.shape == (num_tokens,)):
        return False
    lib = load()
    if lib is None:
        return False
    lib.rotary_embedding_f32(x.data_ptr(), num_tokens, x.stride(0), num_heads, head_dim,
                             positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             torch.get_num_threads())
    return True


def reshape_and_cache(key: Tensor, value: Tensor, kv_cache: Tensor,
                      slot_mapping: Tensor) -> bool:
    """Writes key/value [T, Hkv, D] into kv_cache [2, blocks, block_size, Hkv, D] at the
    slots of slot_mapping [T] (int64): kv_cache[0].view(-1, Hkv, D)[slot_mapping[t]] =
    key[t], and the same for value in kv_cache[1].

    key/value float32 on the CPU with contiguous heads (any token stride: views into a fused
    qkv output qualify); kv_cache float32 or bf16 (KV_CACHE_DTYPES: rounded to nearest even
    as torch rounds). Raises IndexError, writing nothing, for a slot outside the cache.
    Returns False, writing nothing, when the kernel does not apply or is not built.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if not (kv_cache.dtype in KV_CACHE_DTYPES and kv_cache.device.type == "cpu"
            and kv_cache.is_contiguous() and value.shape == key.shape
            and key.dtype == value.dtype == torch.float32 and key.device.type == "cpu"
            and value.device.type == "cpu" and kv_cache.shape[-2:] == key.shape[1:]
            and key.stride(2) == value.stride(2) == 1
            and key.stride(1) == value.stride(1) == head_dim
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.shape == (num_tokens,)):
        return False
    lib = load()
    if lib is None:
        return False
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    write = (lib.reshape_and_cache_bf16 if kv_cache.dtype == torch.bfloat16
             else lib.reshape_and_cache_f32)
    bad = write(
        key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), kv_cache.data_ptr(),
        num_slots, slot_mapping.data_ptr(), num_tokens, row, torch.get_num_threads())
    if bad:
        raise IndexError(f"reshape_and_cache: {bad} slot(s) outside the cache's "
                         f"{num_slots} slots")
    return True


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """x [T, H] / sqrt(mean(x^2) + eps) * weight [H], as a new tensor; None when the kernel
    does not apply (float32 contiguous CPU tensors) or is not built."""
    if not (x.dim() == 2 and weight.shape == x.shape[1:] and _f32_rows(x, weight)):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty_like(x)
    lib.rms_norm_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
                     eps, torch.get_num_threads())
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> bool:
    """In place: residual += x, then x = rms_norm(residual) * weight. x and residual [T, H],
    distinct. Returns False, changing nothing, when the kernel does not apply (float32
    contiguous CPU tensors) or is not built."""
    if not (x.dim() == 2 and residual.shape == x.shape and weight.shape == x.shape[1:]
            and _f32_rows(x, residual, weight)):
        return False
    lib = load()
    if lib is None:
        return False
    lib.fused_add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                               x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return True


def argmax_rows(logits: Tensor) -> Tensor | None:
    """logits [N, V] -> [N] int64: each row's first largest index, a NaN the largest
    (torch.argmax's rule, in 16 lanes: torch walks a row one element at a time); None when
    the kernel does not apply (a float32 contiguous CPU tensor) or is not built."""
    if not (logits.dim() == 2 and logits.shape[1] > 0 and _f32_rows(logits)):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(out.data_ptr(), logits.data_ptr(), logits.shape[0], logits.shape[1],
                        torch.get_num_threads())
    return out


def silu_and_mul(x: Tensor) -> Tensor | None:
    """x [T, 2d] = [gate | up] -> silu(gate) * up [T, d], as a new tensor; None when the
    kernel does not apply (float32 contiguous CPU tensor) or is not built."""
    if not (x.dim() == 2 and x.shape[1] % 2 == 0 and _f32_rows(x)):
        return None
    lib = load()
    if lib is None:
        return None
    d = x.shape[1] // 2
    out = x.new_empty((x.shape[0], d))
    lib.silu_and_mul_f32(out.data_ptr(), x.data_ptr(), x.shape[0], d, torch.get_num_threads())
    return out
