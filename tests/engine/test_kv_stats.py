"""The KV peak in EngineCore.stats() through a real engine step loop: exact block counts."""
from __future__ import annotations

from pathlib import Path

from aioengine import LLM, SamplingParams


def test_kv_peak_and_waste_through_the_engine(tiny_llama_dir: Path,
                                              tiny_prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=16, num_kv_blocks=64)
    core = llm.core
    stats = core.stats()
    assert (stats["kv_peak_blocks"], stats["kv_waste_at_peak"]) == (0, 0.0)
    prompt = tiny_prompts[3]
    assert len(prompt) == 70
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # The last step computes token 81 (70 prompt + 11 fed-back outputs): 6 blocks, 96 slots.
    stats = core.stats()
    assert (stats["kv_peak_blocks"], stats["kv_peak_empty_slots"]) == (6, 15)
    assert stats["kv_waste_at_peak"] == 15 / 96
    assert stats["num_free_blocks"] == 64  # all released; the peak stays until a reset
    core.reset_kv_peak_stats()
    assert core.stats()["kv_peak_blocks"] == 0
    llm.generate(tiny_prompts[4], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    # 9, 10, then 11 tokens in one block: the peak is its first step (9 tokens).
    stats = core.stats()
    assert (stats["kv_peak_blocks"], stats["kv_waste_at_peak"]) == (1, 7 / 16)
