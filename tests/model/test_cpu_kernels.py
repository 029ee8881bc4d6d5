"""The C kernels of aioengine.kernels.cpu against the torch paths they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.model import layers
from aioengine.model.layers import (GEMV_MAX_ROWS, Linear, _num_chunks, linear,
                                    pack_linear_weight)
from aioengine.model.ops import CpuOps
from aioengine.model.rotary import apply_rope

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    # CI and development machines have a C compiler: the kernel must build, not fall back.
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()


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


def _decode_rows(out, q, kv_cache, block_tables, seq_lens, scale) -> bool:
    """paged_attention with one row per request (a decode step's rows)."""
    row_to_req = torch.arange(q.shape[0], dtype=torch.int32)
    return cpu_kernels.paged_attention(out, q, kv_cache, block_tables, row_to_req, seq_lens,
                                       scale)


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", [
    ([1], 9, 3, 64, 16),                       # SmolLM2's shape, first decode
    ([16, 17, 33, 250, 5], 9, 3, 64, 16),     # block boundaries and a long one
    ([7, 1, 12], 4, 4, 32, 1),                # no GQA, one slot per block
    ([40, 3], 8, 2, 128, 8),                  # group of 4, head_dim 128
    ([2048], 2, 1, 16, 16),                   # long context
])
def test_paged_attention_decode_rows_match_torch_path(seq_lens, num_heads, num_kv_heads,
                                                     head_dim, block_size) -> None:
    q, kv_cache, meta = _decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    out = torch.full_like(q, float("nan"))
    assert _decode_rows(out, q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    expected = TorchAttentionBackend(use_cpu_kernel=False)._decode(q, kv_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_paged_attention_declines_what_it_does_not_handle(set_cpu_kernels) -> None:
    q, kv_cache, meta = _decode_case([5, 9], 4, 2, 16, 4)
    out = torch.zeros_like(q)
    args = (meta.block_tables, meta.seq_lens, 0.5)
    # float64, a non-contiguous query, int64 tables: the caller keeps its torch path.
    assert not _decode_rows(out.double(), q.double(), kv_cache.double(), *args)
    assert not _decode_rows(out, q.transpose(0, 1).contiguous().transpose(0, 1), kv_cache,
                            *args)
    assert not _decode_rows(out, q, kv_cache, meta.block_tables.long(), meta.seq_lens, 0.5)
    set_cpu_kernels("0")
    assert not _decode_rows(out, q, kv_cache, *args)
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


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 3, 64), (300, 2, 16)])
def test_reshape_and_cache_matches_index_copy(num_tokens, num_kv_heads, head_dim,
                                              kv_dtype) -> None:
    """K and V as views into a fused qkv output (token stride wider than a row), written to
    scattered slots; 300 tokens take the threaded path. A bf16 cache gets torch's rounding
    bit for bit (values spanning many exponents, ties included)."""
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks, block_size, row = 40, 8, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, 4 * row, generator=gen) * 10.0 ** torch.randint(
        -30, 30, (num_tokens, 4 * row), generator=gen)
    qkv[0, 2 * row] = 1.0 + 2.0 ** -8  # a tie: to even (1.0)
    qkv[0, 2 * row + 1] = 1.0 + 3 * 2.0 ** -8  # a tie: to even (1 + 2^-6)
    k = qkv[:, 2 * row:3 * row].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 3 * row:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=gen).to(kv_dtype)
    expected = kv_cache.clone()
    expected[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(kv_dtype))
    expected[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(kv_dtype))
    assert cpu_kernels.reshape_and_cache(k, v, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_rejects_a_slot_outside_the_cache() -> None:
    kv_cache = torch.zeros(2, 2, 4, 1, 8)
    k = v = torch.ones(2, 1, 8)
    with pytest.raises(IndexError, match="1 slot"):
        cpu_kernels.reshape_and_cache(k, v, kv_cache, torch.tensor([3, 8]))
    assert torch.count_nonzero(kv_cache) == 0  # nothing written, the valid slot neither
    assert not cpu_kernels.reshape_and_cache(k.double(), v.double(), kv_cache.double(),
                                             torch.tensor([0, 1]))
    assert not cpu_kernels.reshape_and_cache(k, v, kv_cache, torch.tensor([0, 1]).int())


@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (3, 100), (130, 64)])
def test_rms_norms_match_torch(num_tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, generator=gen) * 3
    residual = torch.randn(num_tokens, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    expected = F.rms_norm(x, (hidden,), weight, 1e-5)
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert out is not None
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    summed = x + residual
    expected = F.rms_norm(summed, (hidden,), weight, 1e-5)
    x_in, res_in = x.clone(), residual.clone()
    assert cpu_kernels.fused_add_rms_norm(x_in, res_in, weight, 1e-5)
    torch.testing.assert_close(res_in, summed, atol=0, rtol=0)
    torch.testing.assert_close(x_in, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,d", [(1, 1536), (40, 100), (130, 1536)])
def test_silu_and_mul_matches_torch(num_tokens: int, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(num_tokens, 2 * d, generator=gen) * 6
    x[0, :8] = torch.tensor([-200.0, -87.5, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0])
    gate, up = x.chunk(2, dim=-1)
    out = cpu_kernels.silu_and_mul(x)
    assert out is not None and out.shape == (num_tokens, d)
    # Against float64: as close as torch's own float32 SiLU (a few ulp).
    exact = (F.silu(gate.double()) * up.double()).float()
    torch.testing.assert_close(out, exact, atol=1e-30, rtol=5e-7)
    torch.testing.assert_close(F.silu(gate) * up, exact, atol=1e-30, rtol=5e-7)
    assert torch.isnan(cpu_kernels.silu_and_mul(torch.tensor([[float("nan"), 1.0]])))[0, 0]


def test_norm_and_activation_kernels_decline_what_they_do_not_handle(set_cpu_kernels) -> None:
    x, w = torch.randn(4, 8), torch.ones(8)
    assert cpu_kernels.rms_norm(x.double(), w.double(), 1e-6) is None
    assert cpu_kernels.rms_norm(x.t(), torch.ones(4), 1e-6) is None  # not contiguous
    assert not cpu_kernels.fused_add_rms_norm(x, x[:2], w, 1e-6)  # shapes differ
    assert cpu_kernels.silu_and_mul(torch.randn(4, 7)) is None  # odd width
    assert cpu_kernels.silu_and_mul(x.double()) is None
    # The CPU ops give the same answers with the kernels off (torch path).
    residual = torch.randn(4, 8)
    ops = CpuOps()
    rms_norm, fused_add_rms_norm, silu_and_mul = ops.rms_norm, ops.fused_add_rms_norm, ops.silu_and_mul
    with_kernels = (rms_norm(x, w, 1e-6), *fused_add_rms_norm(x.clone(), residual.clone(), w,
                                                              1e-6), silu_and_mul(x))
    set_cpu_kernels("0")
    assert cpu_kernels.rms_norm(x, w, 1e-6) is None
    without = (rms_norm(x, w, 1e-6), *fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6),
               silu_and_mul(x))
    for a, b in zip(with_kernels, without):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
def test_an_unpacked_linear_takes_the_torch_path(storage: str) -> None:
    """There is no row-major C kernel (the loader packs every weight the kernels read,
    Linear.pack): with the kernels built, a Linear left unpacked computes `linear`'s torch
    path at every row count, and no C kernel claims it (kernel_format None: the fused decode
    declines it)."""
    lin = Linear(48, 97, True, torch.float32, CPU)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(97, 48, generator=gen))
        lin.bias.copy_(torch.randn(97, generator=gen))
    lin.convert(storage)
    assert not lin.is_packed and lin.kernel_format is None
    x = torch.randn(9, 48, generator=gen)
    for m in (1, 2, GEMV_MAX_ROWS, 9):
        out = lin(x[:m])
        if storage == "float32":  # the chunked bmm or oneDNN: F.linear up to summation order
            torch.testing.assert_close(out, F.linear(x[:m], lin.weight, lin.bias),
                                       atol=1e-5, rtol=1e-5)
        else:  # oneDNN's bf16 matmul (x and the result rounded); int8 widened per call
            assert torch.equal(out, layers._torch_linear(x[:m], lin.weight, lin.bias,
                                                         lin.scales))


@pytest.mark.parametrize("cpu_kernels_on", [True, False])
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 32, 512])
@pytest.mark.parametrize("out_features", [96, 97, 94, 5 * 3072])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, out_features: int, with_bias: bool,
                                 cpu_kernels_on: bool, set_cpu_kernels) -> None:
    """Few rows take the chunked bmm (kernels on or off: no row-major C kernel), more take
    oneDNN (present in this torch build)."""
    set_cpu_kernels("1" if cpu_kernels_on else "0")
    assert layers._ONEDNN_LINEAR is not None
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


def _argmax_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randn(32, 49152, generator=gen)]
    for n in (1, 7, 8, 9, 16, 17, 100, 151936):
        ties = torch.randint(-3, 3, (3, n), generator=gen).float()  # many equal maxima
        cases.append(ties.clone())
        ties[:, ::7] = float("-inf")
        cases.append(ties.clone())
        ties[0, n // 2], ties[-1, n - 1] = float("nan"), float("nan")  # NaN is the largest
        cases.append(ties.clone())
        cases.append(torch.full((2, n), float("-inf")))  # all -inf: the first
        last = torch.full((2, n), float("-inf"))
        last[:, -1] = 0.0
        cases.append(last)
        cases.append(torch.full((2, n), float("inf")))
    return cases


def test_argmax_rows_is_torch_argmax_in_every_build(restore_cpu_build) -> None:
    """The greedy token: the first largest, a NaN the largest, exactly torch.argmax's, in
    every build this CPU runs (AVX-512, AVX2 and the plain loop differ in code)."""
    cases = _argmax_cases()
    for name in cpu_kernels.supported_variants():
        cpu_kernels.use_variant(name)
        assert cpu_kernels.load() is not None, cpu_kernels.load_error()
        for logits in cases:
            got = cpu_kernels.argmax_rows(logits)
            assert got is not None and torch.equal(got, logits.argmax(dim=1)), (
                name, logits.shape)
    assert cpu_kernels.argmax_rows(cases[0].double()) is None
    assert cpu_kernels.argmax_rows(cases[0].t()) is None  # not contiguous
    assert cpu_kernels.argmax_rows(torch.zeros(2, 0)) is None


@pytest.fixture
def restore_cpu_build():
    yield
    cpu_kernels.use_variant(None)
