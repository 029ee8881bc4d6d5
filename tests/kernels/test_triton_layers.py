"""rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding against their torch
references, and the references against the engine's own ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioengine.kernels.triton import (fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm,
                                      rms_norm_ref, rotary_embedding, rotary_embedding_ref,
                                      silu_and_mul, silu_and_mul_ref)
from aioengine.model.arch import ModelArchConfig
from aioengine.model.rotary import RotaryEmbedding, apply_rope

from tests.kernels.conftest import DTYPES, assert_close


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def test_references_are_the_engines_ops() -> None:
    x, r = torch.randn(5, 96), torch.randn(5, 96)
    w = 1 + 0.2 * torch.randn(96)
    for dtype in (torch.float32, torch.float16):
        xd, rd, wd = x.to(dtype), r.to(dtype), w.to(dtype)
        assert torch.equal(rms_norm_ref(xd, wd, 1e-5), F.rms_norm(xd, (96,), wd, 1e-5))
        normed, total = fused_add_rms_norm_ref(xd, rd, wd, 1e-6)
        assert torch.equal(normed, F.rms_norm(xd + rd, (96,), wd, 1e-6))
        gate_up = torch.randn(4, 2 * 48).to(dtype)
        assert torch.equal(silu_and_mul_ref(gate_up), F.silu(gate_up[:, :48]) * gate_up[:, 48:])
        cos, sin = torch.randn(20, 16).to(dtype), torch.randn(20, 16).to(dtype)
        qk, pos = torch.randn(3, 5, 32).to(dtype), torch.tensor([0, 19, 7])
        assert torch.equal(rotary_embedding_ref(pos, qk, cos, sin),
                           apply_rope(qk, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, device) -> None:
    x = randn(6, 200, dtype=dtype, device=device)  # not a power of two: masked tail
    w = 1 + 0.2 * randn(200, dtype=dtype, device=device, seed=1)
    assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype, fp16_tol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_in_place(dtype, device) -> None:
    x = randn(6, 128, dtype=dtype, device=device)
    residual = randn(6, 128, dtype=dtype, device=device, seed=1)
    w = 1 + 0.2 * randn(128, dtype=dtype, device=device, seed=2)
    normed, total = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    out_x, out_r = fused_add_rms_norm(x, residual, w, 1e-6)
    assert out_x is x and out_r is residual
    assert torch.equal(residual, total)  # one rounding of x + residual, as torch's add
    assert_close(x, normed, dtype, fp16_tol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype, device) -> None:
    x = randn(5, 2 * 300, dtype=dtype, device=device)  # gate | up, 300 not a power of two
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), dtype, fp16_tol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_matches_the_engines_rope(dtype, device) -> None:
    # llama3-scaled frequencies, as the engine builds them; head_dim 64.
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=16, hidden_size=256, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32),
        tie_word_embeddings=False, attention_bias=False, qk_norm=False, bos_token_id=None,
        eos_token_ids=[])
    rotary = RotaryEmbedding(arch, dtype, device)
    positions = torch.tensor([0, 5, 127, 64, 1], device=device)
    # q and k heads side by side, views of one qkv output (row stride 6 + 2 heads).
    qkv = randn(5, 8 * 64, dtype=dtype, device=device)
    qk = qkv[:, :6 * 64].view(5, 6, 64)
    expected = rotary_embedding_ref(positions, qk, rotary.cos, rotary.sin)
    v_before = qkv[:, 6 * 64:].clone()
    q, k = qk.split([4, 2], dim=1)
    rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    assert_close(qk, expected, dtype, fp32_tol=1e-6, fp16_tol=1e-3)
    assert torch.equal(qkv[:, 6 * 64:], v_before)  # v untouched


def test_the_device_ops_agree(device) -> None:
    """TritonOps (the CUDA model's), CpuOps and TorchOps (aioengine.model.ops) give one
    answer for every op a layer calls through them."""
    from aioengine.model.ops import CpuOps, TorchOps, TritonOps

    x, r = randn(5, 96, dtype=torch.float32, device=device), randn(5, 96, dtype=torch.float32,
                                                                    device=device, seed=1)
    w = 1 + 0.2 * randn(96, dtype=torch.float32, device=device, seed=2)
    gate_up = randn(4, 96, dtype=torch.float32, device=device, seed=3)
    cos, sin = randn(20, 16, dtype=torch.float32, device=device, seed=4), randn(
        20, 16, dtype=torch.float32, device=device, seed=5)
    pos = torch.tensor([0, 19, 7], device=device)
    results = []
    for ops in (TorchOps(), CpuOps(), TritonOps()):
        qk = randn(3, 5, 32, dtype=torch.float32, device=device, seed=6)
        rotated = qk if ops.rotary_inplace(qk, pos, cos, sin) else apply_rope(
            qk, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
        results.append((ops.rms_norm(x, w, 1e-6),
                        *ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6),
                        ops.silu_and_mul(gate_up), rotated))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_close(a, b, torch.float32)
