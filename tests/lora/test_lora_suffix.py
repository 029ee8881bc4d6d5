"""Suffix decoding with LoRA: the global tree is kept per adapter, so a request drafts only
from outputs of its own adapter (or of the base model), and greedy tokens still equal
transformers + peft for every request of a mixed batch."""
from __future__ import annotations

from pathlib import Path

from aioengine import LLM
from tests.engine.conftest import assert_blocks_released
from tests.lora.test_lora_engine import GREEDY, _assignments, _requests


def test_mixed_adapters_with_suffix_drafts_match_peft(lora_model_dir: Path, adapter_dirs,
                                                      lora_prompts, peft_greedy) -> None:
    llm = LLM(str(lora_model_dir), dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=8, speculative_config={"method": "suffix",
                                                   "num_speculative_tokens": 6})
    assigned = _assignments(list(adapter_dirs), len(lora_prompts) * 2)
    prompts = lora_prompts * 2
    # Twice: the second round drafts from the first round's outputs, each adapter's own.
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, _requests(adapter_dirs, assigned))
        for i, (a, out) in enumerate(zip(assigned, outs)):
            assert out.outputs[0].token_ids == peft_greedy[a][i % len(lora_prompts)], (i, a)
        assert_blocks_released(llm.core)
    proposer = llm.core.runner.spec_decode.proposer
    proposer.retire_finished()
    assert not proposer.samples
    cache = proposer.global_cache
    assert len(cache.trees) == len(adapter_dirs) + 1  # the base model's and each adapter's
    assert llm.core.stats()["spec_decode_num_accepted_tokens"] > 0
