"""Tree drafting (EAGLE-2, spec_decode/eagle_tree.py) changes how fast tokens come, never
which: greedy output with tree drafts equals greedy output without them, whatever the
cache, budget, preemption or batch (a grammar request, drafted as a chain, included); the
trees are verified and accepted beyond their first level; every block is released."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.config import ConfigError
from aioengine.request import RequestStatus
from aioengine.sampling_params import StructuredOutputs

from tests.engine.conftest import assert_blocks_released
from tests.engine.test_spec_decode import (GREEDY_NARROW, PATTERN, assert_speculated,
                                           n2_logprobs_equal, params_for, spec_prompts)
from tests.eagle_heads import make_random_eagle_head_dir

__all__ = ["spec_prompts"]  # the fixture, shared with test_spec_decode.py

TREE = {"depth": 3, "top_k": 3, "num_nodes": 7}


@pytest.fixture(scope="module")
def tree_spec(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An EAGLE-3 head drafting from the narrowed outputs' tokens (as test_spec_decode's):
    its top-k over them holds the target's next token often, at any depth."""
    head = make_random_eagle_head_dir(tiny_llama_dir, tmp_path_factory.mktemp("tree") / "e3",
                                      "eagle3", seed=2, aux_layer_ids=[0, 1],
                                      draft_token_ids=PATTERN[:4])
    return {"method": "eagle3", "model": str(head), "tree": TREE}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, spec_prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.generate(spec_prompts, params_for(spec_prompts))]


def run(model_dir: Path, prompts: list, params: list, spec: dict | None,
        **engine_args: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), **{"dtype": "float32", "max_model_len": 512,
                                 "speculative_config": spec, **engine_args})
    outs = llm.generate(prompts, params)
    assert_blocks_released(llm.core)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_deep_accepts(llm: LLM) -> None:
    """Trees were verified (more drafts a step than a chain of `depth` has) and some step
    accepted more than one node (a path, not just a first guess)."""
    assert_speculated(llm)
    stats = llm.core.spec_decode.counters
    assert stats.num_draft_tokens > TREE["depth"] * stats.num_drafts
    assert stats.num_accepted_tokens_per_pos[1] > 0, stats.num_accepted_tokens_per_pos


CONFIGS = {
    "default": dict(),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "tiny_budget": dict(max_num_batched_tokens=5),
    "block_size_1": dict(block_size=1),
    "one_seq_at_a_time": dict(max_num_seqs=1),
    "no_chunked_prefill": dict(enable_chunked_prefill=False),
    "async_scheduling": dict(async_scheduling=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_no_speculation(name: str, tiny_llama_dir: Path, tree_spec: dict,
                                      spec_prompts: list[list[int]],
                                      reference: list[list[int]]) -> None:
    tokens, llm = run(tiny_llama_dir, spec_prompts, params_for(spec_prompts), tree_spec,
                      **CONFIGS[name])
    assert tokens == reference
    if name != "tiny_budget":  # 5 tokens a step: trees trimmed to 4 nodes, maybe one level
        assert_deep_accepts(llm)


def test_preemption(tiny_llama_dir: Path, tree_spec: dict, spec_prompts: list[list[int]],
                    reference: list[list[int]]) -> None:
    tokens, llm = run(tiny_llama_dir, spec_prompts, params_for(spec_prompts), tree_spec,
                      block_size=8, num_kv_blocks=20)
    assert llm.core.scheduler.num_preemptions > 0
    assert tokens == reference
    assert_deep_accepts(llm)


def test_prefix_cache_holds_only_the_accepted_path(tiny_llama_dir: Path, tree_spec: dict,
                                                   spec_prompts: list[list[int]]) -> None:
    """Prompts extended by their own outputs hit blocks written by tree steps (accepted
    nodes moved into place) and continue exactly as a cold run does."""
    first, llm = run(tiny_llama_dir, spec_prompts, params_for(spec_prompts), tree_spec)
    follow = [p + o for p, o in zip(spec_prompts, first)]
    hot = llm.generate(follow, params_for(follow))
    assert sum(o.num_cached_tokens for o in hot) > 0
    cold, _ = run(tiny_llama_dir, follow, params_for(follow), None, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in hot] == cold
    assert_blocks_released(llm.core)


def test_grammar_request_in_the_batch(tiny_llama_dir: Path, tree_spec: dict,
                                      spec_prompts: list[list[int]]) -> None:
    """A regex request gets chain drafts (tree.supports_tree) next to tree requests;
    every output is what it is without speculation, and the regex output matches."""
    regex = "[a-f]{30}"
    tokenizer = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512).tokenizer
    bias = {t: 5.0 for t in tokenizer.encode("ab cd ef abcd cdab")}
    constrained = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=bias,
                                 structured_outputs=StructuredOutputs(regex=regex))
    prompts = spec_prompts[4:6] + [tokenizer.encode("abcdabcdab cd ab 1234 abab")]
    params = [GREEDY_NARROW, GREEDY_NARROW, constrained]
    plain, _ = run(tiny_llama_dir, prompts, params, None)
    spec, llm = run(tiny_llama_dir, prompts, params, tree_spec)
    assert spec == plain
    assert re.fullmatch(regex, tokenizer.decode(spec[2], skip_special_tokens=True))
    assert_deep_accepts(llm)


def test_abort_releases_blocks(tiny_llama_dir: Path, tree_spec: dict,
                               spec_prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
              speculative_config=tree_spec)
    core = llm.core
    samples = [s for i, prompt in enumerate(spec_prompts)
               for s in core.add_request(str(i), prompt, GREEDY_NARROW)]
    for _ in range(6):
        core.step()
    assert core.spec_decode.counters.num_drafts > 0
    core.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
    assert_blocks_released(core)


@pytest.mark.parametrize("tree, message", [
    ({"depth": 3, "top_k": 2}, "num_nodes"),
    ({"depth": 4, "top_k": 2, "num_nodes": 3}, "depth"),
    ({"depth": 0, "top_k": 2, "num_nodes": 3}, "depth"),
    ({"depth": 2, "top_k": 2, "num_nodes": 3, "width": 1}, "width"),
])
def test_tree_config_errors(tree: dict, message: str, tiny_llama_dir: Path,
                            tree_spec: dict) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
            speculative_config={**tree_spec, "tree": tree})


def test_ngram_has_no_tree(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="draft head"):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                "tree": TREE})



def test_sliding_window_models_refuse_trees(tmp_path: Path) -> None:
    """Fail closed: a model whose layers attend through a window gets no tree (the masks
    and scratch tables assume one full-attention KV cache group)."""
    from tests.tiny_models import make_tiny_model_dir

    model = make_tiny_model_dir("mistral", tmp_path / "sw", seed=5, sliding_window=32)
    head = make_random_eagle_head_dir(model, tmp_path / "e3", "eagle3", seed=2,
                                      aux_layer_ids=[0, 1])
    with pytest.raises(ConfigError, match="sliding-window"):
        LLM(str(model), dtype="float32", max_model_len=512,
            speculative_config={"method": "eagle3", "model": str(head), "tree": TREE})


def test_a_one_wide_tree_drafts_the_chain(tiny_llama_dir: Path, tree_spec: dict,
                                          spec_prompts: list[list[int]]) -> None:
    """top_k = 1 makes the tree a chain of `depth` argmax drafts: the head's tree rows
    (tree mask, stored from the root's position on) draft what its chain steps draft, so
    every verification keeps as many tokens as the chain's."""
    prompts, params = spec_prompts[4:6], params_for(spec_prompts)[4:6]
    chain = {**tree_spec, "num_speculative_tokens": 3}
    del chain["tree"]
    one_wide = {**tree_spec, "tree": {"depth": 3, "top_k": 1, "num_nodes": 3}}
    stats = []
    for spec in (chain, one_wide):
        _, llm = run(tiny_llama_dir, prompts, params, spec, max_num_seqs=1)
        s = llm.core.spec_decode.counters
        stats.append((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens_per_pos))
    assert stats[0] == stats[1]
    assert stats[0][2][1] > 0


def test_n_greater_than_one_and_logprobs(tiny_llama_dir: Path, tree_spec: dict,
                                         spec_prompts: list[list[int]]) -> None:
    """Logprobs of tokens a tree step emitted are gathered from the accepted path's rows:
    the same as one token at a time (forks of an n = 2 request each draft their trees)."""
    assert_deep_accepts(n2_logprobs_equal(tiny_llama_dir, spec_prompts[4:], tree_spec))
