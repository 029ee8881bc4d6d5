"""Tree drafts with sampling, end to end: recursive rejection sampling over a tree's
children keeps the joint distribution of the sampled tokens (a two-sample chi-square test
against no speculation, as tests/engine/test_spec_decode_sampled.py does for chains), with
penalties that must see each node's path; a seeded request's tokens do not depend on the
batch."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams

from tests.chi_square import ALPHA, chi2_sf, two_sample_statistic
from tests.eagle_heads import make_random_eagle_head_dir
from tests.engine.conftest import assert_blocks_released
from tests.engine.test_spec_decode_sampled import (ENGINE, N_SEEDS, SAMPLED, TRIO,
                                                   assert_drafts_kept_and_rejected, make_llm,
                                                   spec_counters, trio_prompt)

__all__ = ["trio_prompt"]  # the fixture

# Four tokens: after the prompt's one, a tree of up to 2 nodes (usable_drafts' room), most
# often the head's two first guesses, siblings: the second is tried after the first is
# rejected, against p without it.
VARIANTS = {
    "plain": dict(SAMPLED, max_tokens=4),
    "penalties": dict(SAMPLED, max_tokens=4, frequency_penalty=0.8, presence_penalty=0.3,
                      repetition_penalty=1.2),
}


def joint_counts(llm: LLM, prompt: list[int], params: dict) -> collections.Counter:
    outs = llm.generate([prompt] * N_SEEDS,
                        [SamplingParams(seed=i, **params) for i in range(N_SEEDS)])
    assert all(len(o.outputs[0].token_ids) == params["max_tokens"] for o in outs)
    return collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def tree_llm(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """A random EAGLE-3 head over a draft vocabulary of the three narrowed tokens: its two
    best guesses hold the sampled token often, not always."""
    head = make_random_eagle_head_dir(tiny_llama_dir, tmp_path_factory.mktemp("tree") / "e3",
                                      "eagle3", seed=4, aux_layer_ids=[0, 1],
                                      draft_token_ids=TRIO)
    return make_llm(tiny_llama_dir, {"method": "eagle3", "model": str(head),
                                     "tree": {"depth": 2, "top_k": 2, "num_nodes": 3},
                                     "disable_by_batch_size": None},
                    **ENGINE)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampled_tokens_keep_their_joint_distribution(
        variant: str, tree_llm: LLM, tiny_llama_dir: Path, trio_prompt: list[int]) -> None:
    before = spec_counters(tree_llm)
    spec = joint_counts(tree_llm, trio_prompt, VARIANTS[variant])
    after = spec_counters(tree_llm)
    assert_drafts_kept_and_rejected(before, after)
    assert after[1] - before[1] > after[0] - before[0]  # more than one node a tree
    assert_blocks_released(tree_llm.core)
    plain = joint_counts(make_llm(tiny_llama_dir, None, **ENGINE), trio_prompt,
                         VARIANTS[variant])
    assert {t for seq in spec for t in seq} <= set(TRIO)
    stat, df = two_sample_statistic(plain, spec)
    assert df >= 3, (plain, spec)
    assert chi2_sf(stat, df) > ALPHA, (f"chi2 = {stat:.1f}, df = {df}", plain, spec)


def test_seeded_request_keeps_its_tokens_in_any_batch(tree_llm: LLM,
                                                      trio_prompt: list[int]) -> None:
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True,
                            logit_bias={t: 30.0 for t in TRIO})
    alone = tree_llm.generate([trio_prompt], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                            logit_bias={t: 30.0 for t in TRIO})
    crowd = tree_llm.generate([trio_prompt[:5], trio_prompt, trio_prompt[2:]],
                              [others, seeded, others])
    assert crowd[1].outputs[0].token_ids == alone
    assert_blocks_released(tree_llm.core)
