"""The C paged attention over rows (decode and prefill tokens in one call, split at fixed
absolute positions): against the torch backend, and bit-for-bit the same for a token
whatever step it is computed in (issue 29's deterministic attention)."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_build
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata

CPU = torch.device("cpu")
SCALE = 0.125


def _bf16_dot() -> bool:
    """Whether the loaded build takes a bf16 cache's products with vdpbf16ps (the
    AVX512-BF16 builds, attention_bf16.h)."""
    return cpu_kernels.load() is not None and cpu_build.variant() in ("avx512_bf16", "amx")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()


def _cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
           seed: int = 0, dtype: torch.dtype = torch.float32,
           ) -> tuple[torch.Tensor, list[list[int]]]:
    """A random KV cache of `dtype` and scattered block tables holding seq_lens positions
    each."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return kv.to(dtype), tables


def _rows(q_all: list[torch.Tensor], kv: torch.Tensor, tables: list[list[int]],
          query_lens: list[int], seq_lens: list[int], block_size: int,
          window: int | None = None) -> torch.Tensor:
    """The kernel's output for a step of `query_lens` tokens per request (each request's
    last query_lens[i] of its seq_lens[i] positions), q_all[i] holding every position's q."""
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size, CPU)
    q = torch.cat([qa[s - n:s] for qa, n, s in zip(q_all, query_lens, seq_lens)])
    row_to_req = torch.repeat_interleave(torch.arange(len(seq_lens), dtype=torch.int32),
                                         torch.tensor(query_lens))
    row_seq_lens = torch.cat([torch.arange(s - n + 1, s + 1, dtype=torch.int32)
                              for n, s in zip(query_lens, seq_lens)])
    out = torch.full_like(q, float("nan"))
    assert cpu_kernels.paged_attention(out, q, kv, meta.block_tables, row_to_req,
                                       row_seq_lens, SCALE, sliding_window=window)
    return out


# Windows: none, one inside a block, one that starts mid-block and spans a part boundary.
@pytest.mark.parametrize("window", [None, 5, 301])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,seq_lens,heads,kv_heads,head_dim,block_size", [
    ([1, 1, 7, 300], [5, 700, 7, 300], 9, 3, 64, 16),   # decodes, a fresh prompt, a long one
    ([3, 40], [600, 41], 8, 2, 128, 8),                 # a chunk after 597 cached positions
    ([5], [1030], 4, 4, 32, 1),                         # one slot per block, many parts
])
def test_rows_match_the_torch_backend(query_lens, seq_lens, heads, kv_heads, head_dim,
                                      block_size, kv_dtype, window) -> None:
    """A bf16 cache: the kernel widens each element exactly, so the reference is the torch
    backend over the same cache in float32; in the AVX512-BF16 builds it rounds q and the
    softmax weights to bf16 instead (the reference takes the same q). With a window, the
    table entries before every row's window point at a block of huge values (released
    blocks): never read."""
    cache, tables = _cache(seq_lens, kv_heads, head_dim, block_size, dtype=kv_dtype)
    if window is not None:
        poison = cache.shape[1] - 1  # _cache leaves its last 3 blocks unused
        cache[:, poison] = 1e4
        for table, n, s in zip(tables, query_lens, seq_lens):
            released = max(0, s - n - window + 1) // block_size
            table[:released] = [poison] * released
    gen = torch.Generator().manual_seed(1)
    q_all = [torch.randn(s, heads, head_dim, generator=gen) for s in seq_lens]
    ours = _rows(q_all, cache, tables, query_lens, seq_lens, block_size, window)
    bf16_dot = kv_dtype == torch.bfloat16 and head_dim % 32 == 0 and _bf16_dot()
    if bf16_dot:  # the kernel rounds q to bf16 (and its softmax weights, below)
        q_all = [qa.bfloat16().float() for qa in q_all]
    kv = cache.float()
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size, CPU)
    ref = TorchAttentionBackend(use_cpu_kernel=False)
    expected = torch.empty_like(ours)
    qsl = meta.query_start_loc_cpu
    nd = meta.num_decodes
    q = torch.cat([qa[s - n:s] for qa, n, s in zip(q_all, query_lens, seq_lens)])
    if nd:
        expected[:nd] = ref._decode(q[:nd], kv, meta, SCALE, window)
    for i in range(nd, meta.num_reqs):
        # The K/V of the chunk are already in the cache: pass them as the chunk's own.
        s, e = qsl[i], qsl[i + 1]
        k_new, v_new = _gather(kv, tables[i], seq_lens[i] - (e - s), seq_lens[i], block_size)
        expected[s:e] = ref._prefill(i, q[s:e], k_new, v_new, kv, meta, SCALE, window)
    # Each weight rounded to bf16 (a relative 2^-9) moves an output by at most ~2^-9 of
    # the largest |v| (|v| < 5 here): 2.4e-3 at most measured.
    atol, rtol = (5e-3, 1e-2) if bf16_dot else (2e-6, 1e-5)
    torch.testing.assert_close(ours, expected, atol=atol, rtol=rtol)


def _gather(kv: torch.Tensor, table: list[int], begin: int, end: int,
            block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(begin, end)
    blocks = torch.tensor(table)[pos // block_size]
    return kv[0, blocks, pos % block_size], kv[1, blocks, pos % block_size]


@pytest.mark.parametrize("window", [None, 301])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_token_has_the_same_bits_in_every_step_shape(kv_dtype: torch.dtype,
                                                       window: int | None) -> None:
    """Position 699 of a 700-position request: decoded alone, decoded beside others, the
    last token of a fresh 700-token prefill, of a chunk after 512 cached positions, and
    with one thread or two: one result, bit for bit (with a sliding window too)."""
    seq_lens = [700, 90, 300]
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    kv, tables = _cache(seq_lens, kv_heads, head_dim, block_size, seed=5, dtype=kv_dtype)
    gen = torch.Generator().manual_seed(6)
    q_all = [torch.randn(s, heads, head_dim, generator=gen) for s in seq_lens]
    alone = _rows(q_all[:1], kv, tables[:1], [1], [700], block_size, window)[-1]
    shapes = [([1, 1, 1], seq_lens), ([700], [700]), ([188], [700]), ([1, 30, 300], seq_lens)]
    for query_lens, lens in shapes:
        got = _rows(q_all[:len(lens)], kv, tables[:len(lens)], query_lens, lens, block_size,
                    window)
        assert torch.equal(got[query_lens[0] - 1], alone), query_lens
    meta, _ = build_attention_metadata([1], [700], tables[:1], block_size, CPU)
    for threads in (1, 2):
        out = torch.empty(1, heads, head_dim)
        assert cpu_kernels.paged_attention(out, q_all[0][699:700].contiguous(), kv,
                                           meta.block_tables, torch.zeros(1, dtype=torch.int32),
                                           torch.tensor([700], dtype=torch.int32), SCALE,
                                           num_threads=threads, sliding_window=window)
        assert torch.equal(out[0], alone), threads


@pytest.mark.parametrize("window", [None, 5, 301])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_every_row_of_a_chunk_has_its_bits_alone(kv_dtype: torch.dtype,
                                                 window: int | None) -> None:
    """A chunk's rows are attended in blocks of consecutive tokens sharing each position's
    K/V read: every row of a fresh 600-token prefill, of a 77-token chunk after 240 cached
    positions (blocks cross the 256-position part boundary at other offsets) and of a step
    mixing them with a decode equals that token decoded alone, bit for bit."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    kv, tables = _cache([600, 317], kv_heads, head_dim, block_size, seed=11, dtype=kv_dtype)
    gen = torch.Generator().manual_seed(12)
    q_all = [torch.randn(600, heads, head_dim, generator=gen),
             torch.randn(317, heads, head_dim, generator=gen)]
    fresh = _rows(q_all[:1], kv, tables[:1], [600], [600], block_size, window)
    mixed = _rows(q_all, kv, tables, [1, 77], [600, 317], block_size, window)
    for pos in [0, 1, 15, 16, 17, 250, 255, 256, 257, 270, 511, 512, 599]:
        alone = _rows(q_all[:1], kv, tables[:1], [1], [pos + 1], block_size, window)[0]
        assert torch.equal(fresh[pos], alone), pos
    for pos in range(240, 317, 7):
        alone = _rows(q_all[1:], kv, tables[1:], [1], [pos + 1], block_size, window)[0]
        assert torch.equal(mixed[1 + pos - 240], alone), pos
    assert torch.equal(mixed[0], fresh[599])


def test_out_of_range_rows_are_refused_not_read() -> None:
    kv, tables = _cache([20], 2, 16, 4)
    meta, _ = build_attention_metadata([1], [20], tables, 4, CPU)
    q = torch.randn(1, 4, 16)
    out = torch.zeros_like(q)
    for row_to_req, seq_len in ((1, 10), (-1, 10), (0, 0), (0, 21)):
        with pytest.raises(ValueError, match="outside"):
            cpu_kernels.paged_attention(out, q, kv, meta.block_tables,
                                        torch.tensor([row_to_req], dtype=torch.int32),
                                        torch.tensor([seq_len], dtype=torch.int32), SCALE)
    assert torch.count_nonzero(out) == 0


def test_backend_rows_do_not_depend_on_the_step(cpu_backend: bool = True) -> None:
    """The backend's whole forward (K/V written, then the kernel over decode and prefill
    rows): a 12-token chunk beside a decode, the same chunk as 5 + 7 tokens in steps of their
    own, and its last token as a decode: the same bits for every token."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    kv, tables = _cache([50, 37], kv_heads, head_dim, block_size, seed=9)
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(13, heads, head_dim, generator=gen)
    k = torch.randn(13, kv_heads, head_dim, generator=gen)
    v = torch.randn(13, kv_heads, head_dim, generator=gen)
    backend = TorchAttentionBackend(use_cpu_kernel=cpu_backend)

    def run(cache, query_lens, seq_lens, tabs, rows):
        meta, _ = build_attention_metadata(query_lens, seq_lens, tabs, block_size, CPU)
        return backend.forward(q[rows].contiguous(), k[rows].contiguous(),
                               v[rows].contiguous(), cache, meta, SCALE)

    mixed = run(kv.clone(), [1, 12], [50, 37], tables, slice(0, 13))
    assert torch.equal(mixed[:1], run(kv.clone(), [1], [50], tables[:1], slice(0, 1)))
    cache = kv.clone()
    first = run(cache, [5], [30], tables[1:], slice(1, 6))
    second = run(cache, [7], [37], tables[1:], slice(6, 13))
    assert torch.equal(mixed[1:], torch.cat([first, second]))
    cache = kv.clone()
    run(cache, [11], [36], tables[1:], slice(1, 12))
    assert torch.equal(mixed[12:], run(cache, [1], [37], tables[1:], slice(12, 13)))
