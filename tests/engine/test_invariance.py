"""Greedy output is the same whatever the engine settings or batch around a request, and it
equals transformers' greedy output."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine import LLM, SamplingParams

from tests.engine.conftest import assert_blocks_released

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run(model_dir: Path, prompts: list[list[int]], **engine_args: object) -> tuple[list, LLM]:
    llm = LLM(str(model_dir), **{"dtype": "float32", **engine_args})
    outs = llm.generate(prompts, GREEDY)
    assert_blocks_released(llm.core)
    return [o.outputs[0].token_ids for o in outs], llm


CONFIGS = {
    "default": dict(),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "tiny_budget": dict(max_num_batched_tokens=5),
    "no_chunked_prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    "block_size_1": dict(block_size=1),
    "one_seq_at_a_time": dict(max_num_seqs=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_matches_transformers(name: str, tiny_llama_dir: Path,
                                             tiny_prompts: list[list[int]],
                                             tiny_reference: list[list[int]]) -> None:
    tokens, _ = run(tiny_llama_dir, tiny_prompts, max_model_len=512, **CONFIGS[name])
    assert tokens == tiny_reference


def test_preemption_forced_by_a_tiny_kv_cache(tiny_llama_dir: Path,
                                              tiny_prompts: list[list[int]],
                                              tiny_reference: list[list[int]]) -> None:
    # 12 blocks of 8 tokens: the longest request alone (70 + 12 tokens) needs 11.
    tokens, llm = run(tiny_llama_dir, tiny_prompts, block_size=8, num_kv_blocks=12,
                      max_model_len=512)
    assert llm.core.scheduler.num_preemptions > 0
    assert tokens == tiny_reference


def test_alone_equals_in_a_batch(tiny_llama_dir: Path, tiny_prompts: list[list[int]],
                                 tiny_reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=512, dtype="float32")
    for prompt, expected in zip(tiny_prompts[:3], tiny_reference[:3]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert_blocks_released(llm.core)


def test_prefix_cache_is_hit_and_output_unchanged(tiny_llama_dir: Path,
                                                  tiny_prompts: list[list[int]],
                                                  tiny_reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=512, dtype="float32")
    first = llm.generate(tiny_prompts[-2:-1], GREEDY)[0]
    second = llm.generate(tiny_prompts[-1:], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full 16-token blocks of the shared 40
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == tiny_reference[-2:]
    assert llm.core.kv_cache_manager.prefix_cache_hits >= 32


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(1, 96), block_size=st.sampled_from([1, 2, 4, 16]),
       caching=st.booleans(), max_num_seqs=st.integers(1, 8),
       spare_blocks=st.integers(0, 40), order=st.permutations(range(8)))
def test_property_any_settings_any_order(tiny_llama_dir: Path, tiny_prompts: list[list[int]],
                                         tiny_reference: list[list[int]], budget: int,
                                         block_size: int, caching: bool, max_num_seqs: int,
                                         spare_blocks: int, order: list[int]) -> None:
    # Enough blocks for the longest request alone, plus a random surplus: small surpluses
    # force preemption.
    need = -(-(70 + 12) // block_size)
    prompts = [tiny_prompts[i] for i in order]
    tokens, _ = run(tiny_llama_dir, prompts, max_model_len=512, max_num_batched_tokens=budget,
                    block_size=block_size, enable_prefix_caching=caching,
                    max_num_seqs=max_num_seqs, num_kv_blocks=need + spare_blocks)
    assert tokens == [tiny_reference[i] for i in order]
