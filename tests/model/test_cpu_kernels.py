"""The C kernels of aioengine.kernels.cpu against the torch paths they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.model import llama
from aioengine.model.llama import (GEMV_MAX_ROWS, _num_chunks, apply_rope, linear,
                                   pack_linear_weight)

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    # CI and development machines have a C compiler: the kernel must build, not fall back.
    assert cpu_kernels.load() is not None, cpu_kernels._load_error


def _decode_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = [], sum(-(-s // block_size) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for s in seq_lens:  # scattered, non-contiguous blocks
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    meta, _ = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size, CPU)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return q, kv_cache, meta


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", [
    ([1], 9, 3, 64, 16),                       # SmolLM2's shape, first decode
    ([16, 17, 33, 250, 5], 9, 3, 64, 16),     # block boundaries and a long one
    ([7, 1, 12], 4, 4, 32, 1),                # no GQA, one slot per block
    ([40, 3], 8, 2, 128, 8),                  # group of 4, head_dim 128
    ([2048], 2, 1, 16, 16),                   # long context
])
def test_paged_decode_attention_matches_torch_path(seq_lens, num_heads, num_kv_heads,
                                                   head_dim, block_size) -> None:
    q, kv_cache, meta = _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.paged_decode_attention(out, q, kv_cache, meta.block_tables,
                                              meta.seq_lens, 0.125)
    expected = TorchAttentionBackend(use_cpu_kernel=False)._decode(q, kv_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_paged_decode_attention_declines_what_it_does_not_handle(monkeypatch) -> None:
    q, kv_cache, meta = _decode_case([5, 9], 4, 2, 16, 4)
    out = torch.zeros_like(q)
    args = (meta.block_tables, meta.seq_lens, 0.5)
    # float64, a non-contiguous query, int64 tables: the caller keeps its torch path.
    assert not cpu_kernels.paged_decode_attention(out.double(), q.double(), kv_cache.double(),
                                                  *args)
    assert not cpu_kernels.paged_decode_attention(out, q.transpose(0, 1).contiguous()
                                                  .transpose(0, 1), kv_cache, *args)
    assert not cpu_kernels.paged_decode_attention(out, q, kv_cache, meta.block_tables.long(),
                                                  meta.seq_lens, 0.5)
    monkeypatch.setenv("AIOENGINE_CPU_KERNELS", "0")
    assert not cpu_kernels.paged_decode_attention(out, q, kv_cache, *args)
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(1, 12, 64), (37, 6, 128), (512, 3, 16)])
def test_rotary_embedding_matches_torch_in_place(num_tokens, num_heads, head_dim) -> None:
    """In place on the q/k heads of a fused qkv output (token stride wider than the heads),
    leaving the v columns alone, against the torch formula."""
    gen = torch.Generator().manual_seed(num_tokens)
    max_positions = 1000
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                        torch.rand(head_dim // 2, generator=gen))
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen)
    qkv = torch.randn(num_tokens, (num_heads + 2) * head_dim, generator=gen)
    before = qkv.clone()
    qk = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    expected = apply_rope(qk.clone(), cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    assert cpu_kernels.rotary_embedding(qk, positions, cos, sin)
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, num_heads * head_dim:], before[:, num_heads * head_dim:])


def test_rotary_embedding_declines_what_it_does_not_handle() -> None:
    cos = sin = torch.zeros(8, 4)
    x = torch.randn(3, 2, 8)
    positions = torch.tensor([0, 1, 2])
    assert not cpu_kernels.rotary_embedding(x.double(), positions, cos.double(), sin.double())
    assert not cpu_kernels.rotary_embedding(x, positions.int(), cos, sin)
    assert not cpu_kernels.rotary_embedding(x.transpose(0, 1).contiguous().transpose(0, 1)
                                            .transpose(1, 2).contiguous().transpose(1, 2),
                                            positions, cos, sin)  # heads not contiguous
    assert not cpu_kernels.rotary_embedding(x, positions, cos[:, :3], sin[:, :3])


@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 32, 512])
@pytest.mark.parametrize("out_features", [96, 97, 94, 5 * 3072])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, out_features: int, with_bias: bool) -> None:
    """Few rows take the chunked gemv, more take oneDNN (present in this torch build)."""
    assert llama._ONEDNN_LINEAR is not None
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen)
    weight = torch.randn(out_features, 48, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_with_packed_weight_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen)
    weight = torch.randn(96, 48, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    packed = pack_linear_weight(weight)
    assert packed is not None  # float32 on the CPU with oneDNN: packed
    out = linear(x, weight, bias, packed)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert pack_linear_weight(weight.double()) is None


def test_split_linear_chunk_counts() -> None:
    # 4 chunks for layer-sized outputs, ~3,072 rows each for wide ones (capped at 16), always a
    # divisor; a prime count cannot be split (F.linear).
    assert [_num_chunks(n) for n in (576, 960, 3072, 15360, 49152, 151936, 94, 97)] == \
        [4, 4, 4, 5, 16, 16, 2, 1]
