"""`speculative_config {"method": "auto"}` (spec_decode/auto.py): per request and step the
draft of suffix decoding, n-gram lookup or the draft head with the best expected gain.
Greedy output equals no speculation (step shapes, preemption; prefix caching and grammars
in test_spec_decode.py and test_spec_suffix.py),
each method is chosen where it pays, a request whose drafts stop paying stops drafting,
sampled tokens keep their distribution, blocks are released and no request's state is
kept past it."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.config import ConfigError
from aioengine.metrics import SPEC_PER_POS_PREFIX, spec_method_key
from aioengine.spec_decode.auto import (DECAY, HEAD_PRIOR, _Acceptance, _Estimates,
                                        expected_kept)
from aioengine.spec_decode.row_cost import row_cost

from tests.chi_square import ALPHA, chi2_sf, two_sample_statistic
from tests.engine.conftest import assert_blocks_released
from tests.engine.test_spec_decode import (CONFIGS, assert_speculated, generate,
                                           params_for, proposers, reference, spec_prompts)
from tests.engine.test_spec_decode_sampled import (SAMPLED, assert_drafts_kept_and_rejected,
                                                   spec_counters, trio_prompt)

__all__ = ["proposers", "reference", "spec_prompts", "trio_prompt"]  # fixtures, shared

AUTO = {"method": "auto"}


@pytest.fixture(scope="module")
def auto_with_head(proposers: dict) -> dict:
    """auto with the random EAGLE-3 head (its reduced vocabulary holds the narrowed
    outputs, so its drafts are kept often enough to be chosen)."""
    return {"method": "auto", "model": proposers["eagle3"]["model"],
            "head_num_speculative_tokens": 3}


def proposer_of(llm: LLM):
    return llm.core.runner.spec_decode.proposer


def assert_no_request_state(llm: LLM) -> None:
    proposer = proposer_of(llm)
    proposer.retire_finished()
    assert not proposer.suffix.samples
    assert not proposer.tracks


@pytest.mark.parametrize("name", ["default", "tiny_budget", "no_chunked_prefill",
                                  "block_size_1", "layer_path"])
def test_greedy_equals_no_speculation(name: str, tiny_llama_dir: Path, auto_with_head: dict,
                                      spec_prompts: list[list[int]],
                                      reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
              speculative_config=auto_with_head, **CONFIGS[name])
    if name == "layer_path":
        llm.core.loaded.model.use_fused_decode = False
    outs = llm.generate(spec_prompts, params_for(spec_prompts))
    assert_blocks_released(llm.core)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_speculated(llm)
    assert proposer_of(llm).chosen["eagle3"] > 0
    assert proposer_of(llm).chosen["suffix"] > 0
    assert_no_request_state(llm)
    # The random head's drafts are kept at all only in the roomier step shapes.
    kept = ("suffix", "eagle3") if name == "default" else ("suffix",)
    assert_counted_by_method(llm.core.stats(), ("suffix", "ngram", "eagle3"), kept)


def assert_counted_by_method(stats: dict, methods: tuple[str, ...],
                             kept: tuple[str, ...]) -> None:
    """The per-position counts per method (the Prometheus counter's `method` label) add up
    to the totals, and the `kept` methods' drafts were kept."""
    k = next(i for i in range(64) if f"{SPEC_PER_POS_PREFIX}{i}" not in stats)
    for pos in range(k):
        assert stats[f"{SPEC_PER_POS_PREFIX}{pos}"] == sum(
            stats[spec_method_key(pos, m)] for m in methods)
    assert all(stats[spec_method_key(0, m)] > 0 for m in kept)


def test_without_a_head_suffix_and_ngram_draft(tiny_llama_dir: Path,
                                               spec_prompts: list[list[int]],
                                               reference: list[list[int]]) -> None:
    """No head given and none ships for the tiny model: auto drafts by suffix decoding
    (n-gram where it has nothing), with no lookahead slots."""
    tokens, llm = generate(tiny_llama_dir, spec_prompts, params_for(spec_prompts), AUTO)
    assert tokens == reference
    assert proposer_of(llm).head is None
    assert llm.core.speculative_config.uses_draft_head is False
    assert proposer_of(llm).chosen["suffix"] > 0
    assert_speculated(llm)


def test_preemption(tiny_llama_dir: Path, auto_with_head: dict,
                    spec_prompts: list[list[int]], reference: list[list[int]]) -> None:
    tokens, llm = generate(tiny_llama_dir, spec_prompts, params_for(spec_prompts),
                           auto_with_head, block_size=8, num_kv_blocks=14)
    assert llm.core.scheduler.num_preemptions > 0
    assert tokens == reference
    assert_speculated(llm)


def test_sampled_tokens_keep_their_joint_distribution(tiny_llama_dir: Path,
                                                      auto_with_head: dict,
                                                      trio_prompt: list[int]) -> None:
    """As the n-gram and suffix tests: 3 sampled tokens' joint distribution with auto's
    drafts (head chains, suffix drafts from earlier waves' outputs) is the one without
    (unseeded requests: the rejection sampler's)."""
    counts = []
    for spec in (None, {**auto_with_head, "num_speculative_tokens": 2}):
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
                  speculative_config=spec, max_num_seqs=8)
        before = spec_counters(llm) if spec else None
        outs = []
        for wave in range(0, 480, 8):
            outs += llm.generate([trio_prompt] * 8, [SamplingParams(**SAMPLED)] * 8)
        assert_blocks_released(llm.core)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids) for o in outs))
    assert_drafts_kept_and_rejected(before, spec_counters(llm))
    stat, df = two_sample_statistic(*counts)
    assert df >= 3, counts
    assert chi2_sf(stat, df) > ALPHA, (f"chi2 = {stat:.1f}, df = {df}", counts)


def test_a_request_whose_drafts_are_rejected_stops_drafting() -> None:
    """The running estimate: from the prior a 3-token head chain is worth drafting; after
    a few chains rejected at their first token it is not, and after chains kept whole
    again it is."""
    est = _Estimates.starting_from(None)
    k = 3

    def gain() -> float:
        return expected_kept(est.head.rate, k) - row_cost(1) * k

    assert est.head.rate == pytest.approx(HEAD_PRIOR)
    assert gain() > 0
    for _ in range(6):
        est.observe("eagle3", drafted=k, kept=0, score=0.0, decay=DECAY)
    assert gain() <= 0
    for _ in range(3):
        est.observe("eagle3", drafted=k, kept=k, score=0.0, decay=DECAY)
    assert gain() > 0


def test_a_new_request_starts_from_what_all_requests_showed() -> None:
    shared = _Estimates.starting_from(None)
    for _ in range(40):
        shared.observe("suffix", drafted=6, kept=4, score=2.0, decay=0.98)
    fresh = _Estimates.starting_from(shared)
    assert fresh.suffix.ratio == pytest.approx(shared.suffix.ratio) and fresh.suffix.ratio > 1.5
    assert fresh.head.rate == pytest.approx(HEAD_PRIOR)


def test_acceptance_counts_decay() -> None:
    a = _Acceptance.prior(0.5)
    a.observe(drafted=4, kept=2, decay=DECAY)
    assert a.kept == pytest.approx(DECAY * 1.0 + 2)
    assert a.rejected == pytest.approx(DECAY * 1.0 + 1)
    a.observe(drafted=2, kept=2, decay=DECAY)  # kept whole: no rejection seen
    assert a.rejected == pytest.approx(DECAY * (DECAY + 1))
    assert expected_kept(0.5, 3) == pytest.approx(0.875)
    assert expected_kept(1.0, 5) == 5


@pytest.mark.parametrize("spec, match", [
    ({"method": "auto", "tree": {"depth": 2, "top_k": 2, "num_nodes": 3}}, "tree"),
    ({"method": "auto", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "auto", "model": "/nonexistent"}, "speculative_config.model"),
    ({"method": "auto", "head_num_speculative_tokens": 0}, "head_num_speculative_tokens"),
    ({"method": "suffix", "head_num_speculative_tokens": 2}, "only used by method 'auto'"),
    ({"method": "auto", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
])
def test_bad_auto_configs_fail_at_start_up(tiny_llama_dir: Path, spec: dict,
                                           match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny_llama_dir), dtype="float32", speculative_config=spec)



def test_a_verified_rows_price_grows_with_the_step() -> None:
    """Alone a row costs a twentieth of a token; in a step of 32 requests, where the
    forward is compute-bound, most of one: a draft of 8 tokens expected to keep 2 pays
    alone and not there."""
    assert row_cost(1) == pytest.approx(0.05)
    costs = [row_cost(n) for n in (1, 2, 8, 32, 256)]
    assert costs == sorted(costs) and costs[-1] < 1.0
    assert 2.0 - 8 * row_cost(1) > 0 > 2.0 - 8 * row_cost(32)
