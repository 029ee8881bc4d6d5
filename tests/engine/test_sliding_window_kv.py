"""The KV cache of a model whose every layer has a sliding window holds only the blocks the
window can still see: greedy output stays equal to transformers' (full forward, no cache)
under chunked prefill, prefix caching, preemption and schedule-ahead, while the blocks a
request holds stay bounded by the window, not its length."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams

from tests.engine.conftest import (assert_blocks_released, hf_greedy_full_forward,
                                   load_hf_model)
from tests.tiny_models import make_tiny_model_dir

WINDOW = 8
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("mistral", tmp_path_factory.mktemp("tiny_mistral_sw"), seed=5,
                               sliding_window=WINDOW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts inside, at and several windows past the window; three share 40 tokens."""
    rng = random.Random(1)
    out = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 8, 21, 70)]
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    return out + [shared + [rng.randrange(100, 40000) for _ in range(k)] for k in (5, 11, 29)]


@pytest.fixture(scope="module")
def reference(mistral_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, each from a full forward of the whole sequence."""
    return hf_greedy_full_forward(load_hf_model(mistral_dir), prompts, NEW_TOKENS)


CONFIGS = {
    "block_4": dict(block_size=4),
    "chunks_of_5": dict(block_size=4, max_num_batched_tokens=5),
    # Chunks of 16 (more than DECODE_ROWS_CHUNK): prefill attention past the window.
    "chunks_of_16": dict(block_size=4, max_num_batched_tokens=64),
    "no_prefix_caching": dict(block_size=2, enable_prefix_caching=False),
    # 12 blocks of 4 tokens: 48 slots for six requests of up to 94 tokens each.
    "preemption": dict(block_size=4, max_num_batched_tokens=8, num_kv_blocks=12),
    "schedule_ahead": dict(block_size=4, async_scheduling=True),
    # Drafts verified as rows past the window; their lookahead slots never trimmed early.
    "ngram": dict(block_size=4, speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 1,
                                                    "prompt_lookup_max": 2}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_windowed_kv_matches_transformers(name: str, mistral_dir: Path,
                                          prompts: list[list[int]],
                                          reference: list[list[int]]) -> None:
    llm = LLM(str(mistral_dir), dtype="float32", max_model_len=256, **CONFIGS[name])
    kv = llm.core.kv_cache_manager
    assert kv.sliding_window == WINDOW
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_blocks_released(llm.core)
    if name == "preemption":
        assert llm.core.scheduler.num_preemptions > 0
    if name == "ngram":
        stats = llm.core.spec_decode.counters
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_blocks_held_stay_bounded_by_the_window(mistral_dir: Path, prompts: list[list[int]],
                                                reference: list[list[int]]) -> None:
    """One 94-token request in blocks of 4 and steps of at most 5 tokens holds at most
    cdiv(W - 1 + 5, 4) + 1 = 4 blocks at once (24 without the window), and the prefix
    cache still serves a second request sharing its first 40 tokens."""
    llm = LLM(str(mistral_dir), dtype="float32", max_model_len=256, block_size=4,
              max_num_batched_tokens=5)
    kv = llm.core.kv_cache_manager
    assert kv.num_blocks_needed(70 + NEW_TOKENS) == 4
    out = llm.generate([prompts[3]], GREEDY)[0]
    assert out.outputs[0].token_ids == reference[3]
    assert kv.peak_num_blocks <= 4
    first, second = llm.generate(prompts[4:5], GREEDY)[0], llm.generate(prompts[5:6], GREEDY)[0]
    assert second.num_cached_tokens == 40
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == reference[4:6]
    assert_blocks_released(llm.core)


def test_long_chunks_after_a_prefix_hit_past_the_window(mistral_dir: Path,
                                                        prompts: list[list[int]],
                                                        reference: list[list[int]]) -> None:
    """A 40-token prefix hit, then 29 tokens in chunks of 16: prefill attention starts
    several windows into the sequence, over blocks the window still holds."""
    llm = LLM(str(mistral_dir), dtype="float32", max_model_len=256, block_size=4,
              max_num_batched_tokens=64)
    llm.generate(prompts[4:5], GREEDY)
    out = llm.generate(prompts[6:7], GREEDY)[0]
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == reference[6]
    assert_blocks_released(llm.core)


def test_full_attention_layers_keep_every_block(tiny_llama_dir: Path) -> None:
    """No window on some layer (here: none at all): nothing is released early."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4)
    assert llm.core.kv_cache_manager.sliding_window is None
    assert llm.core.kv_cache_manager.num_blocks_needed(94) == 24
