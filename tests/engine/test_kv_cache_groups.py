"""KV cache groups (a model mixing full-attention and sliding-window layers: a tiny Qwen2
whose layer 1 has a window of 8): one block table per group, the windowed group's blocks
released as they fall out of its window. Greedy output equals transformers' (full forward,
no cache) under chunked prefill, prefix caching, preemption, schedule-ahead, n-gram drafts
and parallel samples; the windowed group's blocks stay bounded while group 0's grow."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.kv.kv_cache_groups import GroupedKVCacheManager

from tests.engine.conftest import (assert_blocks_released, hf_greedy_full_forward,
                                   load_hf_model)
from tests.tiny_models import make_tiny_model_dir

WINDOW = 8
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("tiny_qwen2_groups"), seed=7,
                               use_sliding_window=True, sliding_window=WINDOW,
                               max_window_layers=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(2)
    out = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 8, 21, 70)]
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    return out + [shared + [rng.randrange(100, 40000) for _ in range(k)] for k in (5, 29)]


@pytest.fixture(scope="module")
def reference(qwen2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy_full_forward(load_hf_model(qwen2_dir), prompts, NEW_TOKENS)


CONFIGS = {
    "block_4": dict(block_size=4),
    # The windowed group's pool is then 2 x 5 blocks, group 0's 2 x 64: each layer must
    # address its own group's pool.
    "two_seqs": dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=2),
    "chunks_of_5": dict(block_size=4, max_num_batched_tokens=5),
    "chunks_of_16": dict(block_size=4, max_num_batched_tokens=64),
    "no_prefix_caching": dict(block_size=2, enable_prefix_caching=False),
    "preemption": dict(block_size=4, max_num_batched_tokens=8, num_kv_blocks=30),
    "schedule_ahead": dict(block_size=4, async_scheduling=True),
    "ngram": dict(block_size=4, speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 1,
                                                    "prompt_lookup_max": 2}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_kv_matches_transformers(name: str, qwen2_dir: Path, prompts: list[list[int]],
                                         reference: list[list[int]]) -> None:
    llm = LLM(str(qwen2_dir), dtype="float32", max_model_len=256, **CONFIGS[name])
    kv = llm.core.kv_cache_manager
    assert isinstance(kv, GroupedKVCacheManager)
    assert [g.sliding_window for g in kv.groups] == [None, WINDOW]
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_blocks_released(llm.core)
    for m in kv.managers:
        assert m.num_free_blocks == m.num_blocks
    if name == "preemption":
        assert llm.core.scheduler.num_preemptions > 0


def test_window_group_blocks_stay_bounded(qwen2_dir: Path, prompts: list[list[int]],
                                          reference: list[list[int]]) -> None:
    """A 94-token request in blocks of 4, steps of at most 5 tokens: the windowed group
    holds at most cdiv(W - 1 + 5, 4) + 1 = 4 blocks, group 0 all 24; a prefix hit of 40
    tokens is served by both groups; parallel samples (forks) agree."""
    llm = LLM(str(qwen2_dir), dtype="float32", max_model_len=256, block_size=4,
              max_num_batched_tokens=5, max_num_seqs=3)
    full, window = llm.core.kv_cache_manager.managers
    assert window.num_blocks == 3 * 4 < full.num_blocks
    out = llm.generate([prompts[3]], GREEDY)[0]
    assert out.outputs[0].token_ids == reference[3]
    assert full.peak_num_blocks == 24 and window.peak_num_blocks <= 4
    llm.generate(prompts[4:5], GREEDY)
    hit = llm.generate(prompts[5:6], GREEDY)[0]
    assert hit.num_cached_tokens == 40 and hit.outputs[0].token_ids == reference[5]
    forks = llm.generate(prompts[2:3], SamplingParams(n=3, temperature=0.0,
                                                      max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [c.token_ids for c in forks[0].outputs] == [reference[2]] * 3
    assert_blocks_released(llm.core)


def test_layout_fails_closed_to_one_group() -> None:
    """Groups only with window support and without an EAGLE head; the windowed group sized
    for max_num_seqs requests at its bound, group 0 given the bytes that saves."""
    from tiny_models import make_tiny_config

    from aioengine.config import EngineArgs
    from aioengine.engine.kv_setup import kv_cache_layout
    from aioengine.model.arch import ModelArchConfig
    from aioengine.model.layer_spec import layer_specs

    arch = ModelArchConfig.from_hf_config(make_tiny_config(
        "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))
    specs = layer_specs(arch)
    args = EngineArgs(model="unused", block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    grouped = kv_cache_layout(specs, args, 256, 100, windows_supported=True, eagle=False)
    # window group: 2 requests x (cdiv(7 + 8, 4) + 1 = 5) blocks; group 0: 200 - 10
    # layer-blocks of its one layer, capped at 2 x 64 full-length blocks.
    assert grouped.num_blocks == (128, 10) and grouped.grouped
    for kwargs in (dict(windows_supported=False, eagle=False),
                   dict(windows_supported=True, eagle=True)):
        single = kv_cache_layout(specs, args, 256, 100, **kwargs)
        assert not single.grouped and single.num_blocks == (100,)
        assert single.groups[0].sliding_window is None  # layer 0 attends to everything
