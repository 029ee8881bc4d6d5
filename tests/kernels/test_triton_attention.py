"""unified_attention (one launch, split-KV on and off) against its torch reference, and
TritonAttentionBackend against the engine's TorchAttentionBackend."""
from __future__ import annotations

import random

import pytest
import torch

from aioengine.config import ConfigError
from aioengine.kernels.triton import (split_kv_segments, unified_attention,
                                      unified_attention_ref)
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.model.triton_attention import TritonAttentionBackend, select_attention_backend

from tests.kernels.conftest import DTYPES, assert_close


def paged_batch(query_lens: list[int], seq_lens: list[int], num_q_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           list[int]]:
    """(q, kv_cache, query_start_loc, seq_lens, block_tables, unused block ids). Every cache
    slot no request owns holds NaN (unused blocks, the tail of each last block, block 0,
    which pads the tables); blocks are handed out shuffled, so tables are non-contiguous
    and unordered."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 5
    # Block 0 is never owned: the tables' padding (the engine pads with 0) points at NaN.
    pad_block = 0
    ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    tables = [[ids.pop() for _ in range(n)] for n in need]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for table, s in zip(tables, seq_lens):
        for pos in range(s):
            cache[:, table[pos // block_size], pos % block_size] = torch.randn(
                2, num_kv_heads, head_dim, generator=gen)
    width = max(need) + 1
    block_tables = torch.tensor([t + [pad_block] * (width - len(t)) for t in tables],
                                dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen)
    owned = {b for t in tables for b in t}
    unused = [b for b in range(num_blocks) if b not in owned]
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), cache.to(dtype=dtype, **to), qsl.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables.to(**to),
            unused)


# decodes (seq_len 1, a block boundary, a partial block), then prefill chunks with context
# already cached (7 of 23, 3 of 50), and a whole prompt (16 of 16).
MIXED = ([1, 1, 1, 7, 16, 3], [1, 17, 40, 23, 16, 50])
DECODES = ([1, 1, 1], [300, 5, 129])
HEADS = [((4, 4), 64), ((6, 2), 128), ((8, 1), 64)]  # GQA 1, 3, 8
HEAD_IDS = ["mha-d64", "gqa3-d128", "gqa8-d64"]


def check_against_reference(query_lens, seq_lens, heads, head_dim, block_size, dtype, device,
                            num_segments, seed=0) -> None:
    q, cache, qsl, lens, tables, unused = paged_batch(query_lens, seq_lens, *heads, head_dim,
                                                      block_size, dtype, device, seed)
    scale = head_dim ** -0.5
    out = unified_attention(q, cache, torch.empty_like(q), qsl, lens, tables, scale,
                            num_segments=num_segments)
    ref = unified_attention_ref(q, cache, torch.empty_like(q), qsl, lens, tables, scale)
    assert_close(out, ref, dtype)
    # Other garbage in the blocks nobody owns changes nothing, bit for bit.
    cache[:, unused] = 1e4 * torch.randn_like(cache[:, unused])
    again = unified_attention(q, cache, torch.empty_like(q), qsl, lens, tables, scale,
                              num_segments=num_segments)
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", HEADS, ids=HEAD_IDS)
def test_mixed_batch_matches_reference(heads, head_dim, dtype, device) -> None:
    check_against_reference(*MIXED, heads, head_dim, 16, dtype, device, num_segments=1)


@pytest.mark.parametrize("heads,head_dim,dtype", [(*h, d) for h, d in zip(HEADS, [
    torch.float32, torch.float16, torch.float16])], ids=HEAD_IDS)
def test_mixed_batch_split_kv_matches_reference(heads, head_dim, dtype, device) -> None:
    check_against_reference(*MIXED, heads, head_dim, 16, dtype, device, num_segments=4)


@pytest.mark.parametrize("block_size,head_dim,num_segments", [(8, 64, 1), (64, 64, 2),
                                                               (32, 80, 2)])
def test_other_block_sizes_and_head_dims(block_size, head_dim, num_segments, device) -> None:
    check_against_reference(*MIXED, (6, 2), head_dim, block_size, torch.float32, device,
                            num_segments, seed=1)


def test_more_segments_than_tiles(device) -> None:
    # 16 segments over at most 2 tiles of keys: most segments see nothing and weigh 0.
    check_against_reference([1, 5], [9, 40], (4, 2), 64, 16, torch.float32, device,
                            num_segments=16, seed=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_decodes_split_and_unsplit_agree(dtype, device) -> None:
    q, cache, qsl, seq_lens, tables, _ = paged_batch(*DECODES, 8, 1, 128, 16, dtype, device,
                                                     seed=2)
    ref = unified_attention_ref(q, cache, torch.empty_like(q), qsl, seq_lens, tables, 0.1)
    for segments in (1, 8):
        out = unified_attention(q, cache, torch.empty_like(q), qsl, seq_lens, tables, 0.1,
                                num_segments=segments)
        assert_close(out, ref, dtype)


def test_padding_rows_past_the_last_request_are_left_alone(device) -> None:
    q, cache, qsl, seq_lens, tables, _ = paged_batch([1, 5], [9, 20], 4, 2, 64, 16,
                                                     torch.float32, device, seed=3)
    padded = torch.cat([q, torch.randn(3, 4, 64, device=device)])
    for segments in (1, 2):
        out = torch.full_like(padded, 7.0)
        unified_attention(padded, cache, out, qsl, seq_lens, tables, 0.125,
                          num_segments=segments)
        assert (out[6:] == 7.0).all()
        ref = unified_attention_ref(q, cache, torch.empty_like(q), qsl, seq_lens, tables, 0.125)
        assert_close(out[:6], ref, torch.float32)


def test_split_heuristic() -> None:
    # decode-only, few sequences x heads for the SMs, long context: split
    assert split_kv_segments(2, 8, 1, 4096, num_sms=132) > 1
    assert split_kv_segments(2, 8, 4, 4096, num_sms=132) == 1  # a prefill in the step
    assert split_kv_segments(64, 8, 1, 4096, num_sms=132) == 1  # enough programs already
    assert split_kv_segments(2, 8, 1, 100, num_sms=132) == 1  # short contexts


def _engine_step(seed: int = 4):
    """A step as the engine builds it: decodes first, then chunks with cached context."""
    rng = random.Random(seed)
    query_lens, seq_lens = [1, 1, 5, 12], [19, 33, 21, 12]
    block_size, num_blocks = 16, 24
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    return query_lens, seq_lens, tables, block_size, num_blocks


@pytest.mark.parametrize("kv_dtype,num_kv_segments", [(torch.float32, None),
                                                      (torch.float32, 4),
                                                      (torch.float16, None)], ids=str)
def test_backend_matches_torch_backend(kv_dtype, num_kv_segments, device) -> None:
    query_lens, seq_lens, tables, block_size, num_blocks = _engine_step()
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    gen = torch.Generator().manual_seed(5)
    num_tokens, hq, hkv, d = sum(query_lens), 6, 2, 64
    # The context of each request is already in the cache; this step's K/V are not.
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(kv_dtype)
    q, k, v = (torch.randn(num_tokens, h, d, generator=gen).to(device)
               for h in (hq, hkv, hkv))
    cache = cache.to(device)
    torch_cache, triton_cache = cache.clone(), cache.clone()
    expected = TorchAttentionBackend(use_cpu_kernel=False).forward(
        q, k, v, torch_cache, meta, 0.125)
    backend = TritonAttentionBackend(device, num_kv_segments=num_kv_segments)
    got = backend.forward(q, k, v, triton_cache, meta, 0.125)
    assert torch.equal(triton_cache, torch_cache)  # the same slots written, the same values
    tol = 2e-5 if kv_dtype == torch.float32 else 2e-3
    assert_close(got, expected, torch.float32, fp32_tol=tol)


def test_backend_splits_only_long_decode_only_steps(device) -> None:
    backend = TritonAttentionBackend(device)
    backend.num_sms = 132
    long_decodes, _ = build_attention_metadata([1, 1], [1000, 700], [list(range(63)),
                                               list(range(63, 107))], 16, device)
    assert backend.segments(long_decodes, num_kv_heads=8) > 1
    mixed, _ = build_attention_metadata([1, 4], [1000, 700], [list(range(63)),
                                        list(range(63, 107))], 16, device)
    assert backend.segments(mixed, num_kv_heads=8) == 1


def test_select_attention_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert type(select_attention_backend("torch", cpu)) is TorchAttentionBackend
    assert type(select_attention_backend("auto", cpu)) is TorchAttentionBackend
    if not torch.cuda.is_available():
        assert isinstance(select_attention_backend("triton", cpu), TritonAttentionBackend)
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
            select_attention_backend("triton", cpu)
    else:
        cuda = torch.device("cuda")
        assert isinstance(select_attention_backend("auto", cuda), TritonAttentionBackend)
