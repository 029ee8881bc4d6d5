"""Attention metadata, the torch paged-attention backend (vs a naive reference) and the
runner's copy_blocks (worker/step_layout.py)."""
from __future__ import annotations

import pytest
import torch

from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.model.llama import kv_cache_bytes_per_block, make_kv_caches
from aioengine.worker.step_layout import copy_blocks

CPU = torch.device("cpu")


def test_metadata_exact_values() -> None:
    # Two decodes, then a 4-token chunk after 3 cached tokens, then a fresh 2-token prompt.
    meta, positions = build_attention_metadata(
        query_lens=[1, 1, 4, 2], seq_lens=[5, 9, 7, 2],
        block_tables=[[7, 2], [4, 0, 9], [5, 8], [3]], block_size=4, device=CPU)
    assert positions.tolist() == [4, 8, 3, 4, 5, 6, 0, 1]
    assert positions.dtype == torch.int64
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 9 * 4 + 0, 5 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1,
                                          8 * 4 + 2, 3 * 4 + 0, 3 * 4 + 1]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 1, 2, 6, 8]
    assert meta.query_start_loc.dtype == torch.int32
    assert meta.query_start_loc_cpu == [0, 1, 2, 6, 8]
    assert meta.seq_lens.tolist() == [5, 9, 7, 2] == meta.seq_lens_cpu
    assert meta.seq_lens.dtype == torch.int32
    # Padded with block 0 to the longest table.
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 9], [5, 8, 0], [3, 0, 0]]
    assert meta.block_tables.dtype == torch.int32
    assert (meta.num_actual_tokens, meta.num_reqs, meta.num_decodes) == (8, 4, 2)
    assert (meta.max_query_len, meta.max_seq_len, meta.max_decode_seq_len) == (4, 9, 9)


def test_num_decodes_counts_only_the_leading_run() -> None:
    meta, _ = build_attention_metadata([1, 3, 1], [2, 3, 6], [[0], [1], [2, 3]], 4, CPU)
    assert meta.num_decodes == 1
    meta, _ = build_attention_metadata([2, 1], [2, 3], [[0], [1]], 4, CPU)
    assert meta.num_decodes == 0


def test_small_decode_steps_get_the_same_metadata_without_numpy(monkeypatch) -> None:
    from aioengine.model import attention

    seq_lens, tables = [5, 9, 1, 16], [[7, 2], [4, 0, 9], [6], [1, 3, 5, 8]]
    small, small_pos = build_attention_metadata([1] * 4, seq_lens, tables, 4, CPU)
    monkeypatch.setattr(attention, "SMALL_DECODE_MAX_REQS", 0)  # the numpy path
    full, full_pos = build_attention_metadata([1] * 4, seq_lens, tables, 4, CPU)
    assert small_pos.tolist() == full_pos.tolist() == [4, 8, 0, 15]
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        a, b = getattr(small, name), getattr(full, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    for name in ("num_actual_tokens", "num_reqs", "num_decodes", "max_query_len",
                 "max_seq_len", "query_start_loc_cpu", "seq_lens_cpu", "max_decode_seq_len"):
        assert getattr(small, name) == getattr(full, name), name
    assert small.slot_mapping.tolist() == [2 * 4 + 0, 9 * 4 + 0, 6 * 4 + 0, 8 * 4 + 3]


@pytest.mark.parametrize("query_lens,seq_lens,tables,match", [
    ([1], [0], [[0]], "query_len"),
    ([1], [5], [[0]], "too short"),
    ([3], [2], [[0]], "query_len"),
    ([0], [2], [[0]], "query_len"),
    ([2], [9], [[0, 1]], "too short"),
    ([1, 1], [2], [[0], [1]], "equally long"),
])
def test_metadata_rejects_bad_input(query_lens, seq_lens, tables, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(query_lens, seq_lens, tables, 4, CPU)


def _reference(q, kv_cache, meta, scale, block_size, window=None):
    """Naive attention: for each query token, softmax over its request's keys 0..position
    (the last `window` of them)."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        slots = [int(meta.block_tables[i, p // block_size]) * block_size + p % block_size
                 for p in range(seq_len)]  # out-of-window entries read, then not weighed
        keys = kv_cache[0].flatten(0, 1)[slots]  # [S, Hkv, D]
        values = kv_cache[1].flatten(0, 1)[slots]
        for t in range(start, end):
            pos = seq_len - (end - start) + (t - start)
            lo = 0 if window is None else max(0, pos + 1 - window)
            for h in range(num_heads):
                kh, vh = keys[lo:pos + 1, h // group], values[lo:pos + 1, h // group]
                weights = torch.softmax((kh @ q[t, h]) * scale, dim=0)
                out[t, h] = weights @ vh
    return out


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_backend_matches_naive_reference(num_heads: int, num_kv_heads: int,
                                         use_cpu_kernel: bool) -> None:
    """Mixed batch: decodes of different lengths, a chunk after cached context, a fresh prompt,
    and a late query_len == 1 request (prefill path). Earlier context is pre-filled in the cache.
    Decodes go through the C kernel or the torch path."""
    gen = torch.Generator().manual_seed(0)
    head_dim, block_size, num_blocks = 8, 4, 40
    query_lens, seq_lens = [1, 1, 1, 5, 6, 1], [3, 13, 1, 9, 6, 7]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[used:used + n])
        used += n
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size, CPU)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    out = TorchAttentionBackend(use_cpu_kernel).forward(q, k, v, kv_cache, meta, scale=0.3)
    # The new tokens' K/V landed in their slots...
    flat = kv_cache.flatten(1, 2)
    assert torch.equal(flat[0, meta.slot_mapping], k)
    assert torch.equal(flat[1, meta.slot_mapping], v)
    # ...and attention over the whole cache (old context + new tokens) is exact.
    torch.testing.assert_close(out, _reference(q, kv_cache, meta, 0.3, block_size),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 5, 8])
def test_windowed_attention_reads_only_the_window(window: int) -> None:
    """Decodes and chunks after cached context, several windows long, whose table entries
    before the window point at block 0 (released blocks: NULL_BLOCK), here filled with
    huge values: the torch path (where a window is narrower than a context) reads only
    the window's blocks and equals the naive windowed reference."""
    gen = torch.Generator().manual_seed(1)
    head_dim, block_size, num_blocks, heads, kv_heads = 8, 4, 60, 4, 2
    query_lens, seq_lens = [1, 1, 1, 9, 12, 3], [4, 21, 30, 26, 12, 17]
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for q_len, s in zip(query_lens, seq_lens):
        n = -(-s // block_size)
        # what the KV manager released: blocks wholly before (context - window + 1)
        released = max(0, s - q_len - window + 1) // block_size
        tables.append([0] * released + perm[used:used + n - released])
        used += n - released
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, block_size, CPU)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    kv_cache[:, 0] = 1e4
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    out = TorchAttentionBackend().forward(q, k, v, kv_cache, meta, scale=0.3,
                                          sliding_window=window)
    expected = _reference(q, kv_cache, meta, 0.3, block_size, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_copy_blocks_copies_every_layer_and_nothing_else() -> None:
    caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]
    before = [c.clone() for c in caches]
    copy_blocks(caches, src=[1, 4], dst=[5, 0])
    for c, b in zip(caches, before):
        assert torch.equal(c[:, 5], b[:, 1]) and torch.equal(c[:, 0], b[:, 4])
        assert torch.equal(c[:, 1:5], b[:, 1:5])
    copy_blocks(caches, [], [])
    with pytest.raises(ValueError):
        copy_blocks(caches, [1], [])


def test_kv_cache_shapes_and_bytes() -> None:
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False, bos_token_id=1,
        eos_token_ids=[2])
    caches = make_kv_caches(arch, num_blocks=10, block_size=8, dtype=torch.float32, device=CPU)
    assert len(caches) == 3
    assert all(c.shape == (2, 10, 8, 2, 16) and c.dtype == torch.float32 for c in caches)
    per_block = kv_cache_bytes_per_block(arch, 8, torch.float32)
    assert per_block == 2 * 8 * 2 * 16 * 4 * 3
    assert per_block * 10 == sum(c.numel() * c.element_size() for c in caches)
    assert kv_cache_bytes_per_block(arch, 8, torch.bfloat16) == per_block // 2
