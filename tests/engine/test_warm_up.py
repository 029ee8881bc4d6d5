"""ModelRunner.warm_up (the start-up dummy step): its size, and the KV cache left clean."""
from __future__ import annotations

from pathlib import Path

import torch

from aioengine import LLM, SamplingParams


def test_warm_up_fits_the_cache_and_leaves_it_zeroed(tiny_llama_dir: Path,
                                                     tiny_prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=8, max_model_len=100)
    runner = llm.core.runner
    # EngineCore ran it at start-up; nothing it wrote is left, no block is held.
    assert all(torch.count_nonzero(cache) == 0 for cache in runner.kv_caches)
    assert llm.core.stats()["num_free_blocks"] == 8
    # 512 tokens as requests of <= 100 need 36 blocks; halved until they fit in 8:
    # 64 tokens, one request of 4 blocks.
    assert runner.warm_up(512, 100) == 64
    assert runner.warm_up(96, 100) == 96  # 96 tokens in 6 blocks fit as they are
    assert runner.warm_up(512, 10) == 64  # 7 requests of <= 10 tokens, a block each
    assert all(torch.count_nonzero(cache) == 0 for cache in runner.kv_caches)
    # The engine still serves, and a cache hit cannot find anything the warm-up wrote.
    out = llm.generate(tiny_prompts[1], SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.core.stats()["prefix_cache_hits"] == 0
