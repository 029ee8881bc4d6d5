"""Suffix decoding through the engine: greedy output equals no speculation (every step
shape the n-gram tests cover, preemption, prefix caching, grammars), drafts up to k = 32
are verified, sampled tokens keep their distribution, and every block is released; the
proposer drops each request's tree once it finished (nothing is kept past a request)."""
from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.sampling_params import StructuredOutputs

from tests.chi_square import ALPHA, chi2_sf, two_sample_statistic
from tests.engine.conftest import assert_blocks_released
from tests.engine.test_spec_decode import (CONFIGS, NARROW, assert_speculated, generate,
                                           params_for, reference, spec_prompts)
from tests.engine.test_spec_decode_sampled import (SAMPLED, assert_drafts_kept_and_rejected,
                                                   spec_counters, trio_prompt)

__all__ = ["reference", "spec_prompts", "trio_prompt"]  # fixtures, shared

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def proposer_of(llm: LLM):
    return llm.core.runner.spec_decode.proposer


def assert_no_request_state(llm: LLM) -> None:
    """Every finished sample's own tree is gone (after the next step's propose, or now)."""
    proposer = proposer_of(llm)
    proposer.retire_finished()
    assert not proposer.samples


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_no_speculation(name: str, tiny_llama_dir: Path,
                                      spec_prompts: list[list[int]],
                                      reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
              speculative_config=SUFFIX, **CONFIGS[name])
    if name == "layer_path":
        llm.core.loaded.model.use_fused_decode = False
    outs = llm.generate(spec_prompts, params_for(spec_prompts))
    assert_blocks_released(llm.core)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_speculated(llm)
    assert_no_request_state(llm)
    # A second pass also drafts from the first pass's outputs (the global tree): the
    # same tokens again.
    again = llm.generate(spec_prompts, params_for(spec_prompts))
    assert [o.outputs[0].token_ids for o in again] == reference
    assert_blocks_released(llm.core)
    assert_no_request_state(llm)
    assert len(proposer_of(llm).global_cache.cached) == 2 * len(spec_prompts)


def test_preemption(tiny_llama_dir: Path, spec_prompts: list[list[int]],
                    reference: list[list[int]]) -> None:
    tokens, llm = generate(tiny_llama_dir, spec_prompts, params_for(spec_prompts), SUFFIX,
                           block_size=8, num_kv_blocks=14)
    assert llm.core.scheduler.num_preemptions > 0
    assert tokens == reference
    assert_speculated(llm)
    assert_no_request_state(llm)


def test_drafts_up_to_32_tokens(tiny_llama_dir: Path, spec_prompts: list[list[int]]) -> None:
    """With k = 32 and a deep tree, drafts longer than 16 tokens are verified and kept in
    one step (the scheduler and the fused decode rows take them; the second run drafts
    from the first one's output too), and the output is still the one-token-a-time one."""
    spec = {"method": "suffix", "num_speculative_tokens": 32,
            "suffix_decoding_max_tree_depth": 64, "suffix_decoding_max_spec_factor": 2.0}
    prompts = spec_prompts[5:6]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True,
                            logit_bias=NARROW)
    plain, _ = generate(tiny_llama_dir, prompts, params, None)
    tokens, llm = generate(tiny_llama_dir, prompts, params, spec)
    assert tokens == plain
    again = llm.generate(prompts, params)
    assert again[0].outputs[0].token_ids == plain[0]
    assert_blocks_released(llm.core)
    stats = llm.core.stats()
    assert stats["spec_decode_num_accepted_tokens_per_pos_24"] > 0, stats
    assert_no_request_state(llm)


@pytest.mark.parametrize("spec", [SUFFIX, {"method": "auto"}], ids=["suffix", "auto"])
def test_structured_output(tiny_llama_dir: Path, spec: dict) -> None:
    """Drafts are cut to what the grammar accepts; the output equals the one-token-a-time
    output and matches (suffix decoding, and auto choosing among its proposers)."""
    regex = "[a-f]{30}"
    outs = []
    for config in (None, spec):
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
                  speculative_config=config)
        bias = {t: 5.0 for t in llm.tokenizer.encode("ab cd ef abcd cdab")}
        params = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=bias,
                                structured_outputs=StructuredOutputs(regex=regex))
        prompt = llm.tokenizer.encode("abcdabcdab cd ab 1234 abab")
        outs.append([o.outputs[0] for o in llm.generate([prompt, prompt], params)])
        assert_blocks_released(llm.core)
    assert_speculated(llm)
    for a, b in zip(*outs):
        assert re.fullmatch(regex, b.text)
        assert (a.text, a.token_ids) == (b.text, b.token_ids)


N_SEEDS = 600


def test_sampled_tokens_keep_their_joint_distribution(tiny_llama_dir: Path,
                                                      trio_prompt: list[int]) -> None:
    """As the n-gram test (test_spec_decode_sampled.py): the joint distribution of 3
    sampled tokens with suffix drafts (from the prompt and, soon, from earlier requests'
    outputs) is the one without, by a two-sample chi-square test (unseeded requests: the
    rejection sampler's)."""
    counts = []
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 2}):
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
                  speculative_config=spec, max_num_seqs=64)
        before = spec_counters(llm) if spec else None
        # In waves, so later requests draft from the outputs of finished ones.
        outs = []
        for wave in range(0, N_SEEDS, 60):
            outs += llm.generate([trio_prompt] * 60, [SamplingParams(**SAMPLED)] * 60)
        assert_blocks_released(llm.core)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids) for o in outs))
    assert_drafts_kept_and_rejected(before, spec_counters(llm))
    stat, df = two_sample_statistic(*counts)
    assert df >= 3, counts
    assert chi2_sf(stat, df) > ALPHA, (f"chi2 = {stat:.1f}, df = {df}", counts)


@pytest.mark.parametrize("spec", [SUFFIX, {"method": "auto"}, {"method": "ngram",
                                   "num_speculative_tokens": 4, "prompt_lookup_min": 2}],
                         ids=["suffix", "auto", "ngram"])
def test_drafts_through_the_stop_token_that_completes_the_grammar(tiny_llama_dir: Path,
                                                                  spec: dict) -> None:
    """The prompt holds every answer the grammar allows, each followed by the stop token, so
    the drafts copy one through that token: the verified row after it needs a mask too
    (xgrammar refuses one past a stop token, which failed the whole step). Without
    jump-forward, which would append the forced tokens undrafted."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, speculative_config=spec,
              structured_jump_forward=False)
    eos = llm.tokenizer.eos_token_id
    prompt = []
    for digit in range(10):
        prompt += llm.tokenizer.encode(f'{{"a": {digit}}}') + [eos]
    regex = r'\{"a": [0-9]\}'
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputs(regex=regex))
    outs = [o.outputs[0] for o in llm.generate([prompt] * 3, params)]
    outs += [o.outputs[0] for o in llm.generate([prompt], params)]
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out
    assert_speculated(llm)
    assert_blocks_released(llm.core)


SEEDED = [SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=1.0, repetition_penalty=1.2, min_p=0.01, seed=4,
                         max_tokens=40, ignore_eos=True)]


@pytest.mark.parametrize("spec", [SUFFIX, {"method": "auto"}, {"method": "ngram",
                                   "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}],
                         ids=["suffix", "auto", "ngram"])
def test_seeded_sampling_gives_the_tokens_of_no_speculation(tiny_llama_dir: Path,
                                                             spec_prompts: list[list[int]],
                                                             spec: dict) -> None:
    """A seeded request's tokens are those it gets without speculation, whatever the drafts:
    the second round is drafted from the first round's outputs (suffix decoding's global
    tree) and keeps long runs of them, the third runs each request alone. The second half
    is narrowed to a repeating pattern, which n-gram lookups match."""
    prompts = spec_prompts[:len(SEEDED)] + spec_prompts[4:4 + len(SEEDED)]
    params = SEEDED + [dataclasses.replace(p, logit_bias=NARROW) for p in SEEDED]
    want, _ = generate(tiny_llama_dir, prompts, params, None)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, speculative_config=spec)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert alone == want
    assert_speculated(llm)
    assert_blocks_released(llm.core)


@pytest.mark.parametrize("spec", [SUFFIX, {"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_min": 1, "prompt_lookup_max": 3}],
                         ids=["suffix", "ngram"])
def test_seeded_sampling_under_a_grammar_that_jumps_forward(tiny_llama_dir: Path,
                                                            spec: dict) -> None:
    """Drafts copied from the prompt run through the grammar's forced stretches ("=" and
    " " below). The step after a draft that forced tokens follow ends the request's run
    there, and a seeded request drew for the rows after it where sampling without drafts
    appends the forced tokens undrawn, so its text changed with the drafts (a served
    n = 2 JSON-schema request streamed other text than the same request unstreamed).
    Drafts now stop before such a token; the tokens are those of no speculation."""
    regex = r"([0-9][0-9][0-9]=[0-9] ){6}"

    def run(config: dict | None) -> tuple[LLM, list[list[int]]]:
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
                  speculative_config=config)
        prompt = llm.tokenizer.encode("123=4 567=8 912=3 123=4 567=8 912=3 123=4 567=8 ")
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                                 structured_outputs=StructuredOutputs(regex=regex))
                  for seed in range(6)]
        return llm, [o.outputs[0].token_ids for o in llm.generate([prompt] * 6, params)]

    want = run(None)[1]
    llm, got = run(spec)
    assert got == want
    assert_speculated(llm)
    assert_blocks_released(llm.core)
