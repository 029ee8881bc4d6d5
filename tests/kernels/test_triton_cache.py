"""reshape_and_cache against its torch reference and the engine's write_to_kv_cache."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels.triton import reshape_and_cache, reshape_and_cache_ref
from aioengine.model.attention import write_to_kv_cache

from tests.kernels.conftest import DTYPES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_writes_every_slot_and_skips_padding(dtype, device) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 6, 16, 2, 64
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(device)
    # k, v as the model hands them: row-strided views of one qkv output.
    qkv = torch.randn(7, 4 * d + 2 * hkv * d, generator=gen).to(dtype).to(device)
    k = qkv[:, 4 * d:4 * d + hkv * d].view(7, hkv, d)
    v = qkv[:, 4 * d + hkv * d:].view(7, hkv, d)
    slots = torch.tensor([5, -1, 16, 95, 40, -1, 0], device=device)  # -1: padding
    expected = cache.clone()
    reshape_and_cache_ref(k, v, expected, slots)
    reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)
    # The engine's torch path agrees where no slot is padding.
    engine = cache.clone()
    keep = slots >= 0
    write_to_kv_cache(k[keep].contiguous(), v[keep].contiguous(), engine, slots[keep])
    assert torch.equal(engine, cache)


def test_casts_to_the_cache_dtype_and_extra_rows_are_ignored(device) -> None:
    cache = torch.zeros(2, 2, 8, 1, 32, dtype=torch.float16, device=device)
    k = torch.randn(4, 1, 32, device=device)  # fp32 activations, fp16 cache, 4 rows
    v = torch.randn(4, 1, 32, device=device)
    slots = torch.tensor([3, 9], device=device)  # only the first two rows are tokens
    reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache[0, 0, 3, 0], k[0, 0].half())
    assert torch.equal(cache[1, 1, 1, 0], v[1, 0].half())
    assert int((cache != 0).sum()) == 4 * 32
