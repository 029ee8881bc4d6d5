"""Speculative decoding with sampling, end to end: drafts change how fast tokens come,
never their distribution; seeded requests keep their tokens in any batch; async
scheduling and drafts together keep greedy tokens (and logprobs) and release every
block; logprobs of tokens that came out of a verification step are the model's own.

The tiny random model repeats itself only with its vocabulary narrowed (logit_bias) to
a few tokens; prompts repeat those tokens so the n-gram proposer always finds drafts
(tests/engine/test_spec_decode.py has the greedy-equality tests this file builds on).
"""
from __future__ import annotations

import asyncio
import collections
import math
import random
from pathlib import Path

import pytest

from aioengine import LLM, AsyncEngine, SamplingParams

from tests.chi_square import ALPHA, chi2_sf, two_sample_statistic
from tests.engine.conftest import assert_blocks_released


def ngram(k: int, **extra: object) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, **extra}


_rng = random.Random(7)
PATTERN = [_rng.randrange(100, 40000) for _ in range(6)]  # as in test_spec_decode.py
NARROW = {t: 30.0 for t in PATTERN}
TRIO = PATTERN[:3]
TRIO_BIAS = {t: 30.0 for t in TRIO}


def make_llm(model_dir: Path, spec: dict | None, **engine_args: object) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "max_model_len": 512,
                                  "speculative_config": spec, **engine_args})


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.core.stats()
    return (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"])


def assert_drafts_kept_and_rejected(before: tuple[int, int, int],
                                    after: tuple[int, int, int]) -> None:
    """Between two snapshots drafts were verified, some kept and some rejected: both
    branches of the rejection sampler ran (else a distribution test proves little)."""
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    assert drafts > 0, "no drafts were verified"
    assert 0 < accepted < draft_tokens, (accepted, draft_tokens)


# ---- (a) the sampled path keeps the target distribution ---------------------------------

# Requests per distribution and per engine, unseeded: their draws come from the engine's
# shared generator, through the rejection sampler (a seeded request's chain is drawn row by
# row instead, its tokens those without speculation: test_spec_suffix's seeded test).
# Enough to fail a rejection sampler whose residual keeps the rejected draft (p ~ 1e-16
# here), or rows whose penalties ignore the drafts before them (p ~ 1e-65): both tried by
# patching the runner.
N_SEEDS = 1000
SAMPLED = dict(temperature=0.8, top_k=2, top_p=0.95, max_tokens=3, ignore_eos=True,
               logit_bias=TRIO_BIAS)
VARIANTS = {
    "plain": SAMPLED,
    # Penalties must see the drafts accepted before each verified position (they are
    # output tokens by then); the repetition penalty alone would not tell, since every
    # narrowed token is in the prompt.
    "penalties": dict(SAMPLED, frequency_penalty=0.8, presence_penalty=0.3,
                      repetition_penalty=1.2),
}
ENGINE = dict(max_num_seqs=256, max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def trio_prompt(tiny_llama_dir: Path) -> list[int]:
    """A pattern of the 3 tokens, then the narrowed model's own greedy continuation of it:
    each token occurs with a successor in the prompt, so after any first token the lookup
    finds a draft, and the drafts follow the model closely enough to be kept often but not
    always. 18 tokens: the first block (16) is shared through the prefix cache, which
    keeps the runs short."""
    seed = TRIO * 2
    out = make_llm(tiny_llama_dir, None).generate(
        [seed], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                               logit_bias=TRIO_BIAS))
    return seed + out[0].outputs[0].token_ids


def joint_counts(llm: LLM, prompt: list[int], params: dict) -> collections.Counter:
    outs = llm.generate([prompt] * N_SEEDS,
                        [SamplingParams(**params) for _ in range(N_SEEDS)])
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    return collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def plain_counts(tiny_llama_dir: Path, trio_prompt: list[int]) -> dict[str, collections.Counter]:
    llm = make_llm(tiny_llama_dir, None, **ENGINE)
    return {name: joint_counts(llm, trio_prompt, params) for name, params in VARIANTS.items()}


@pytest.fixture(scope="module")
def spec_llm(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir, ngram(2), **ENGINE)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampled_tokens_keep_their_joint_distribution(
        variant: str, spec_llm: LLM, trio_prompt: list[int],
        plain_counts: dict[str, collections.Counter]) -> None:
    """The joint distribution of the 3 tokens is the same with speculation as without, by
    a two-sample chi-square test. With speculation the 2nd token is verified against a
    one-token draft (max_tokens leaves room for one): kept, and the 3rd is the bonus token
    of the same step, or rejected and redrawn from the residual, and the 3rd comes from a
    plain step."""
    before = spec_counters(spec_llm)
    spec = joint_counts(spec_llm, trio_prompt, VARIANTS[variant])
    assert_drafts_kept_and_rejected(before, spec_counters(spec_llm))
    assert_blocks_released(spec_llm.core)
    plain = plain_counts[variant]
    # Every token is one of the narrowed ones (top_k = 2 leaves 2 of them per step).
    assert {t for seq in spec for t in seq} <= set(TRIO)
    stat, df = two_sample_statistic(plain, spec)
    assert df >= 3, (plain, spec)  # several outcomes, or the test says little
    assert chi2_sf(stat, df) > ALPHA, (f"chi2 = {stat:.1f}, df = {df}", plain, spec)


# ---- (b) a seeded request keeps its tokens in any batch ----------------------------------

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True,
                        logit_bias=NARROW)
SEEDED_PROMPT = PATTERN * 3 + PATTERN[:2]


def crowd(tiny_prompts: list[list[int]]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Other traffic: unseeded sampled (narrowed, so they draft too, and not), greedy
    (narrowed and not), another seeded request, long prompts (chunked prefills)."""
    looped = [11, 12, 13] + PATTERN * 4
    prompts = [looped, tiny_prompts[3], PATTERN * 2, tiny_prompts[1], looped, tiny_prompts[5],
               PATTERN[::-1] * 3]
    params = [
        SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logit_bias=NARROW),
        SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias=NARROW),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=99, max_tokens=18, ignore_eos=True,
                       logit_bias=NARROW, frequency_penalty=0.2),
        SamplingParams(temperature=1.0, top_p=0.8, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True, logit_bias=NARROW),
    ]
    return prompts, params


@pytest.mark.parametrize("engine_args", [
    dict(),
    # Other requests' decodes and prefill chunks take most of each step's budget.
    dict(max_num_batched_tokens=12),
], ids=["default_budget", "tight_budget"])
def test_seeded_request_same_alone_and_in_a_batch(engine_args: dict, tiny_llama_dir: Path,
                                                  tiny_prompts: list[list[int]]) -> None:
    llm = make_llm(tiny_llama_dir, ngram(4), **engine_args)
    before = spec_counters(llm)
    alone = llm.generate([SEEDED_PROMPT], SEEDED)[0].outputs[0].token_ids
    assert len(alone) == 20
    assert_drafts_kept_and_rejected(before, spec_counters(llm))
    prompts, params = crowd(tiny_prompts)
    for at in (0, 3, len(prompts)):  # first, among, after the others
        outs = llm.generate(prompts[:at] + [SEEDED_PROMPT] + prompts[at:],
                            params[:at] + [SEEDED] + params[at:])
        assert outs[at].outputs[0].token_ids == alone, f"seeded request at {at}"
        assert_blocks_released(llm.core)
    # Another engine, with another seed for the shared generator: the same tokens.
    other = make_llm(tiny_llama_dir, ngram(4), seed=5, **engine_args)
    outs = other.generate(prompts + [SEEDED_PROMPT], params + [SEEDED])
    assert outs[-1].outputs[0].token_ids == alone


# ---- (c) async scheduling with drafts ----------------------------------------------------

def async_workload(tiny_prompts: list[list[int]]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests, most narrowed (so they draft), with logprobs (which show any KV
    or position error the narrowed argmax would hide), one ending on a stop token."""
    rng = random.Random(11)
    prompts, params = [], []
    for i in range(10):
        narrowed = i % 4 != 3
        if narrowed:
            start = rng.randrange(6)
            prompts.append([rng.randrange(100, 40000) for _ in range(rng.randrange(1, 5))]
                           + (PATTERN[start:] + PATTERN[:start]) * rng.randrange(1, 4))
        else:
            prompts.append(tiny_prompts[i % len(tiny_prompts)])
        params.append(SamplingParams(
            temperature=0.0, max_tokens=rng.randrange(4, 28), ignore_eos=True, logprobs=1,
            logit_bias=NARROW if narrowed else None,
            stop_token_ids=[PATTERN[0]] if i == 5 else None))
    return prompts, params


async def run_async(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams],
                    delays: list[float], **engine_args: object) -> tuple[list, dict, int]:
    engine = await AsyncEngine.create(str(model_dir), dtype="float32", max_model_len=512,
                                      **engine_args)
    try:
        async def one(i: int) -> tuple:
            await asyncio.sleep(delays[i])
            outs = [o async for o in engine.generate(prompts[i], params[i], request_id=f"r{i}")]
            tokens = [t for o in outs for t in o.outputs[0].token_ids]
            logprobs = [lp for o in outs for lp in (o.outputs[0].logprobs or [])]
            return tokens, logprobs, outs[-1].outputs[0].finish_reason

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        assert_blocks_released(engine.core)
        return results, engine.core.stats(), engine.core.scheduler.num_steps_ahead
    finally:
        await engine.shutdown()


def assert_same_greedy_run(got: tuple, want: tuple, i: int) -> None:
    tokens, logprobs, reason = got
    assert tokens == want[0], f"request {i}: tokens"
    assert reason == want[2], f"request {i}: finish reason"
    assert len(logprobs) == len(tokens), f"request {i}: {len(logprobs)} logprobs entries"
    for pos, (a, b) in enumerate(zip(logprobs, want[1])):
        assert list(a) == list(b), f"request {i} position {pos}: logprob tokens"
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4), (
                f"request {i} position {pos}: logprob of {tok}: {a[tok].logprob} "
                f"(speculation, async) vs {b[tok].logprob}")
            assert a[tok].rank == b[tok].rank


@pytest.fixture(scope="module")
def async_reference(tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> list[tuple]:
    prompts, params = async_workload(tiny_prompts)
    outs = make_llm(tiny_llama_dir, None).generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason)
            for o in outs]


@pytest.mark.parametrize("engine_args", [
    dict(speculative_config=ngram(3)),
    dict(speculative_config=ngram(3), max_num_batched_tokens=16),
    # Speculation switches off above 2 running requests: steps are then scheduled ahead,
    # and drafts come back when the batch shrinks (or an arrival makes it grow mid-step).
    dict(speculative_config=ngram(3, disable_by_batch_size=2)),
], ids=["ngram", "tight_budget", "disable_by_batch_size"])
async def test_async_greedy_with_drafts_equals_no_speculation(
        engine_args: dict, tiny_llama_dir: Path, tiny_prompts: list[list[int]],
        async_reference: list[tuple]) -> None:
    prompts, params = async_workload(tiny_prompts)
    rng = random.Random(3)
    delays = [0.0, 0.0] + [rng.random() * 0.15 for _ in prompts[2:]]  # staggered arrivals
    results, stats, ahead = await run_async(tiny_llama_dir, prompts, params, delays,
                                            **engine_args)
    for i, (got, want) in enumerate(zip(results, async_reference)):
        assert_same_greedy_run(got, want, i)
    assert stats["spec_decode_num_drafts"] > 0
    if "disable_by_batch_size" in engine_args["speculative_config"]:
        # Both mechanisms took turns. Drafts only come while at most 2 requests run, so
        # how many (and whether any is kept) depends on timing: a loaded CI machine once
        # verified 3 and kept none.
        assert ahead > 0
    else:
        assert stats["spec_decode_num_accepted_tokens"] > 0


def test_no_step_is_scheduled_ahead_of_a_step_that_verifies_drafts(
        tiny_llama_dir: Path, async_reference: list[tuple],
        tiny_prompts: list[list[int]]) -> None:
    """The async loop, stepped by hand (schedule, schedule ahead, execute, update): a step
    that verifies drafts keeps an unknown number of tokens, so the step after it cannot
    be scheduled before its update, even when it proposes no drafts itself. Here two
    requests draft with speculation on (2 running <= disable_by_batch_size); a third
    arrives, is admitted in the step that verifies their drafts and takes the batch past
    the limit, so that step proposes nothing."""
    prompts, params = async_workload(tiny_prompts)
    llm = make_llm(tiny_llama_dir, ngram(3, disable_by_batch_size=2))
    core = llm.core
    picked = [0, 1, 3]  # two narrowed requests, then a plain one
    tokens = {i: [] for i in picked}
    logprobs = {i: [] for i in picked}
    core.add_request("r0", prompts[0], params[0])
    core.add_request("r1", prompts[1], params[1])
    ahead, num_steps, drafts_in_flight = None, 0, 0
    while core.has_unfinished_requests():
        num_steps += 1
        if num_steps == 4:
            core.add_request("r3", prompts[3], params[3])
        if ahead is None:
            step = core.schedule()
        else:
            step, ahead = ahead, None
        ahead = core.schedule_ahead(step)
        verifies = any(item.spec_token_ids for item in step.scheduled)
        drafts_in_flight += verifies
        assert ahead is None or not verifies, (
            f"step {step.step_id} verifies drafts {[i.spec_token_ids for i in step.scheduled]} "
            f"and step {ahead.step_id} was scheduled ahead of it")
        for out in core.update(step, core.execute(step)):
            i = int(out.request.request_id[1:])
            tokens[i] += out.new_token_ids
            logprobs[i] += out.new_logprobs or []
    assert drafts_in_flight > 0
    for i in picked:
        assert_same_greedy_run((tokens[i], logprobs[i], async_reference[i][2]),
                               async_reference[i], i)
    assert_blocks_released(core)


# ---- (d) logprobs of sampled tokens with drafts -------------------------------------------

def test_sampled_logprobs_with_drafts_are_the_models_own(tiny_llama_dir: Path) -> None:
    """Each emitted token (kept draft, residual draw or bonus) has one logprobs entry: its
    own logprob first, finite, with a rank consistent with the top-K listed, and values
    equal to the raw model logprobs at that position (rescored without speculation)."""
    k = 3
    prompts = [SEEDED_PROMPT, [11, 12, 13] + PATTERN * 4, PATTERN[::-1] * 3]
    params = [SamplingParams(temperature=t, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True,
                             logit_bias=NARROW, logprobs=k, frequency_penalty=fp)
              for t, s, fp in ((0.8, 1, 0.0), (1.0, 2, 0.0), (0.7, 3, 0.3))]
    llm = make_llm(tiny_llama_dir, ngram(4))
    before = spec_counters(llm)
    outs = llm.generate(prompts, params)
    assert_drafts_kept_and_rejected(before, spec_counters(llm))
    assert_blocks_released(llm.core)
    # Rescoring: prompt_logprobs of prompt + output give the raw logprobs of every output
    # token at its position, computed in one prefill without any draft.
    rescored = make_llm(tiny_llama_dir, None).generate(
        [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k))
    for prompt, out, ref in zip(prompts, outs, rescored):
        sample = out.outputs[0]
        assert len(sample.token_ids) == 16
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        expected = ref.prompt_logprobs[len(prompt):]
        for pos, (tok, entry, want) in enumerate(zip(sample.token_ids, sample.logprobs,
                                                     expected)):
            assert next(iter(entry)) == tok, f"position {pos}: the sampled token comes first"
            lp = entry[tok]
            assert math.isfinite(lp.logprob) and lp.logprob <= 0.0
            others = [e for t, e in entry.items() if t != tok]
            assert len(others) in (k - 1, k)  # the sampled token may be one of the top K
            if lp.rank <= k:
                assert tok in [t for t, e in entry.items() if e.rank == lp.rank]
                assert sum(e.logprob > lp.logprob for e in others) == lp.rank - 1
            else:
                assert len(others) == k and all(e.logprob >= lp.logprob for e in others)
            assert sorted(e.rank for e in others) == [r for r in range(1, k + 1)
                                                      if r != lp.rank or len(others) == k]
            assert lp.logprob == pytest.approx(want[tok].logprob, abs=1e-4), f"position {pos}"
            # Past the top K a rank counts the vocabulary's larger logits, thousands of them
            # computed by the decode kernel here and by a prefill there: ties within float
            # rounding may order differently (rank 6022 vs 6023 seen, equal logprobs).
            if lp.rank <= k:
                assert lp.rank == want[tok].rank, f"position {pos}"
            else:
                assert abs(lp.rank - want[tok].rank) <= 2, f"position {pos}"
            assert entry.keys() == want.keys(), f"position {pos}"
            assert ({t: e.logprob for t, e in entry.items()}
                    == pytest.approx({t: e.logprob for t, e in want.items()}, abs=1e-4))
