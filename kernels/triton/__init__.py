"""Triton kernels for the GPU path, each beside a plain-torch reference (`*_ref`, the same
signature: the spec the tests compare against).

On a machine without CUDA they run under Triton's interpreter: TRITON_INTERPRET=1 must be
in the environment before this package is first imported (`triton.jit` reads it when the
kernels are defined). The interpreter handles fp32 and fp16, not bf16.
"""
from aioengine.kernels.triton.activation import silu_and_mul, silu_and_mul_ref
from aioengine.kernels.triton.attention import (split_kv_segments, unified_attention,
                                                unified_attention_ref)
from aioengine.kernels.triton.cache import reshape_and_cache, reshape_and_cache_ref
from aioengine.kernels.triton.layernorm import (fused_add_rms_norm, fused_add_rms_norm_ref,
                                                rms_norm, rms_norm_ref)
from aioengine.kernels.triton.lora import (lora_expand, lora_expand_ref, lora_shrink,
                                           lora_shrink_ref, lora_token_groups)
from aioengine.kernels.triton.moe import fused_moe, fused_moe_ref, moe_align
from aioengine.kernels.triton.rotary import rotary_embedding, rotary_embedding_ref

__all__ = [
    "fused_add_rms_norm", "fused_add_rms_norm_ref", "fused_moe", "fused_moe_ref", "moe_align",
    "lora_expand", "lora_expand_ref",
    "lora_shrink", "lora_shrink_ref", "lora_token_groups", "reshape_and_cache",
    "reshape_and_cache_ref", "rms_norm", "rms_norm_ref", "rotary_embedding",
    "rotary_embedding_ref", "silu_and_mul", "silu_and_mul_ref", "split_kv_segments",
    "unified_attention", "unified_attention_ref",
]
