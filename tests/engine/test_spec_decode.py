"""Speculative decoding changes how fast tokens come, never which: greedy output with drafts
equals greedy output without, whatever the batch, budget, cache or stop rule; blocks are
all released; the prefix cache only ever holds verified KV."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.config import ConfigError
from aioengine.sampling_params import StructuredOutputs

from tests.eagle_heads import make_random_eagle_head_dir
from tests.engine.conftest import assert_blocks_released

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
_rng = random.Random(7)
PATTERN = [_rng.randrange(100, 40000) for _ in range(6)]
# A random model's greedy output never repeats itself; with the vocabulary narrowed to the
# pattern's tokens it soon cycles, and lookups find their drafts.
NARROW = {t: 30.0 for t in PATTERN}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
GREEDY_NARROW = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                               logit_bias=NARROW)
NUM_PLAIN = 4  # spec_prompts[:NUM_PLAIN] take GREEDY, the rest GREEDY_NARROW


@pytest.fixture(scope="module")
def spec_prompts(tiny_prompts: list[list[int]]) -> list[list[int]]:
    """Some tiny prompts plus ones that repeat themselves, so lookups find matches."""
    looped = [_rng.randrange(100, 40000) for _ in range(3)] + PATTERN * 4
    return tiny_prompts[:4] + [looped, PATTERN * 3 + PATTERN[:2], tiny_prompts[6],
                               tiny_prompts[4]]


def params_for(prompts: list, narrow: SamplingParams = GREEDY_NARROW,
               plain: SamplingParams = GREEDY) -> list[SamplingParams]:
    return [plain if i < NUM_PLAIN else narrow for i in range(len(prompts))]


@pytest.fixture(scope="module")
def proposers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """speculative_config per proposer. The random heads cannot guess a random model's
    tokens, but the EAGLE-3 one drafts from a reduced vocabulary (d2t) that holds the
    narrowed outputs: its argmax over those is right often enough to be accepted."""
    root = tmp_path_factory.mktemp("heads")
    eagle = make_random_eagle_head_dir(tiny_llama_dir, root / "eagle", "eagle", seed=1)
    eagle3 = make_random_eagle_head_dir(tiny_llama_dir, root / "eagle3", "eagle3", seed=2,
                                        aux_layer_ids=[0, 1], draft_token_ids=PATTERN[:4])
    return {"ngram": NGRAM,
            "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": str(eagle)},
            "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "model": str(eagle3)}}


def generate(model_dir: Path, prompts: list[list[int]], params: SamplingParams | list,
             spec: dict | None, **engine_args: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), **{"dtype": "float32", "max_model_len": 512,
                                 "speculative_config": spec, **engine_args})
    outs = llm.generate(prompts, params)
    assert_blocks_released(llm.core)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, spec_prompts: list[list[int]]) -> list[list[int]]:
    return generate(tiny_llama_dir, spec_prompts, params_for(spec_prompts), None)[0]


def assert_speculated(llm: LLM, accepted: bool = True) -> None:
    """The run verified drafts and kept some (else the test proves nothing; a random
    EAGLE-1 head's drafts are never right, `accepted=False`)."""
    stats = llm.core.stats()
    assert stats["spec_decode_num_drafts"] > 0
    if accepted:
        assert stats["spec_decode_num_accepted_tokens"] > 0


CONFIGS = {
    "default": dict(),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "tiny_budget": dict(max_num_batched_tokens=3),
    "no_chunked_prefill": dict(enable_chunked_prefill=False),
    "block_size_1": dict(block_size=1),
    "one_seq_at_a_time": dict(max_num_seqs=1),
    "priority": dict(scheduling_policy="priority"),
    "layer_path": dict(),  # the fused C decode kernel off
}


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_no_speculation(name: str, method: str, tiny_llama_dir: Path,
                                      spec_prompts: list[list[int]], proposers: dict,
                                      reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
              speculative_config=proposers[method], **CONFIGS[name])
    if name == "layer_path":
        llm.core.loaded.model.use_fused_decode = False
    outs = llm.generate(spec_prompts, params_for(spec_prompts))
    assert_blocks_released(llm.core)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_speculated(llm, accepted=method != "eagle")


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_preemption_with_drafts(method: str, tiny_llama_dir: Path, proposers: dict,
                                spec_prompts: list[list[int]],
                                reference: list[list[int]]) -> None:
    tokens, llm = generate(tiny_llama_dir, spec_prompts, params_for(spec_prompts),
                           proposers[method], block_size=8,
                           num_kv_blocks=14)
    assert llm.core.scheduler.num_preemptions > 0
    assert tokens == reference
    assert_speculated(llm)


def test_stops_inside_an_accepted_draft(tiny_llama_dir: Path,
                                        spec_prompts: list[list[int]],
                                        reference: list[list[int]]) -> None:
    """Stop tokens and max_tokens that fall inside a run of accepted drafts end the
    output exactly where a one-token-a-time run ends it."""
    params = []
    for i, ref in enumerate(reference):
        stop_at = ref[len(ref) // 2]  # a token the greedy output reaches mid-way
        params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at],
                                     logit_bias=None if i < NUM_PLAIN else NARROW))
    params += [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logit_bias=NARROW)
               for n in (5, 11)]
    prompts = spec_prompts + spec_prompts[4:6]
    plain = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512).generate(prompts, params)
    spec, llm = generate(tiny_llama_dir, prompts, params, NGRAM)
    assert spec == [o.outputs[0].token_ids for o in plain]
    assert_speculated(llm)
    finals = llm.generate(prompts, params)
    assert ([(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in finals]
            == [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in plain])


def test_stop_string_inside_a_draft(tiny_llama_dir: Path, spec_prompts: list[list[int]]) -> None:
    """Text and token ids end at the stop string, as without drafts."""
    base = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512)
    prompts = spec_prompts[4:6]
    probe = base.generate(prompts, GREEDY_NARROW)
    # The text of the first 7 tokens first occurs when the 7th is out: inside the run of
    # drafts the second verification step accepts (the outputs cycle from token 2 or 3).
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias=NARROW,
                             stop=[base.tokenizer.decode(o.outputs[0].token_ids[:7]).strip()])
              for o in probe]
    plain = base.generate(prompts, params)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, speculative_config=NGRAM)
    spec = llm.generate(prompts, params)
    assert_blocks_released(llm.core)
    for a, b in zip(spec, plain):
        assert len(b.outputs[0].token_ids) == 7
        assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason) == (
            b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason)
    assert_speculated(llm)


def n2_logprobs_equal(model_dir: Path, prompts: list[list[int]], spec: dict) -> LLM:
    """n = 2 with logprobs, greedy: the same tokens, logprobs and ranks with `spec` as
    without it; returns the speculating LLM."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2, logprobs=2,
                            logit_bias=NARROW)
    plain = LLM(str(model_dir), dtype="float32", max_model_len=512).generate(prompts, params)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert_blocks_released(llm.core)
    for a, b in zip(outs, plain):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert [list(lp) for lp in x.logprobs] == [list(lp) for lp in y.logprobs]
            for lx, ly in zip(x.logprobs, y.logprobs):
                for tok in lx:
                    assert lx[tok].logprob == pytest.approx(ly[tok].logprob, abs=1e-4)
                    assert lx[tok].rank == ly[tok].rank
    return llm


def test_n_greater_than_one_and_logprobs(tiny_llama_dir: Path,
                                         spec_prompts: list[list[int]]) -> None:
    assert_speculated(n2_logprobs_equal(tiny_llama_dir, spec_prompts[4:], NGRAM))


# Suffix decoding's follow-up turns also draft from the first turns' outputs (its global tree).
@pytest.mark.parametrize("spec", [NGRAM, {"method": "suffix", "num_speculative_tokens": 8},
                                  {"method": "auto"}], ids=["ngram", "suffix", "auto"])
def test_prefix_cache_holds_only_verified_kv(tiny_llama_dir: Path,
                                             spec_prompts: list[list[int]],
                                             reference: list[list[int]], spec: dict) -> None:
    """A second request whose prompt is the first one's prompt and output hits the blocks
    the first one wrote with drafts (rejected ones included) and still continues exactly
    as a cold run does."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, speculative_config=spec)
    first = llm.generate(spec_prompts, params_for(spec_prompts))
    follow = [p + o.outputs[0].token_ids for p, o in zip(spec_prompts, first)]
    hot = llm.generate(follow, params_for(follow))
    assert sum(o.num_cached_tokens for o in hot) > 0
    cold, _ = generate(tiny_llama_dir, follow, params_for(follow), None,
                       enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in hot] == cold
    assert_blocks_released(llm.core)


def test_structured_output_with_drafts(tiny_llama_dir: Path) -> None:
    """A regex request: drafts are cut to what the grammar accepts, each verified position
    is masked, and the output equals the one-token-a-time output (and matches)."""
    regex = "[a-f]{30}"
    for jump_forward in (True, False):
        outs = []
        for spec in (None, NGRAM):
            llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
                      speculative_config=spec, structured_jump_forward=jump_forward)
            # Nudged towards a few letter tokens, the output soon repeats itself.
            bias = {t: 5.0 for t in llm.tokenizer.encode("ab cd ef abcd cdab")}
            params = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=bias,
                                    structured_outputs=StructuredOutputs(regex=regex))
            prompt = llm.tokenizer.encode("abcdabcdab cd ab 1234 abab")
            outs.append(llm.generate([prompt], params)[0].outputs[0])
            assert_blocks_released(llm.core)
        assert_speculated(llm)
        assert re.fullmatch(regex, outs[1].text)
        assert (outs[1].text, outs[1].token_ids) == (outs[0].text, outs[0].token_ids)


@pytest.mark.parametrize("spec, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "/nonexistent"},
     "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown field"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_configs_fail_at_start_up(tiny_llama_dir: Path, spec: object,
                                                  match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny_llama_dir), dtype="float32", speculative_config=spec)
