"""The families past Llama (aioengine/model/families.py) beyond test_llama_vs_hf's checks: who
runs their decode steps (the fused C executor declines every layer option it does not list,
and decode then runs layerwise), Gemma's local / global layers over sequences several
windows long, and the whole engine (chunked prefill, prefix caching, preemption) against
transformers' greedy tokens."""
from __future__ import annotations

import random

import pytest
import torch
from hf_compare import ATOL, RTOL, assert_matches_hf, hf_sampled_logits
from paged_driver import PagedDriver, Seq
from tiny_models import FAMILY_ARCHS, make_tiny_model_dir

from aioengine import LLM, SamplingParams
from aioengine.model.executors import FusedCpuDecodeExecutor
from aioengine.model.loader import load_model

from tests.engine.conftest import assert_blocks_released, hf_greedy_full_forward

CPU = torch.device("cpu")
# The layer options each family uses (none: the fused executor runs its decode steps).
FEATURES = {
    "gemma2": {"hidden_act", "attn_scale", "attn_logit_softcapping", "norm_style",
               "sliding_window"},
    "gemma3": {"hidden_act", "attn_scale", "norm_style", "qk_norm", "sliding_window",
               "local_rope"},
    "phi3": set(), "olmo2": {"norm_style", "qk_norm_whole"},
    "granite": {"attn_scale", "residual_multiplier"}, "smollm3": {"use_rope"},
    "llama_yarn": set(),
}


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def family(request, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


@torch.inference_mode()
def test_decode_runs_fused_only_without_unlisted_features(family, set_cpu_kernels) -> None:
    """Fail closed: a model whose layers use options the fused executor does not list is
    declined and every decode step runs layerwise; the others decode fused. Both give
    transformers' logits."""
    set_cpu_kernels("1")
    name, path, hf = family
    ours = load_model(str(path), torch.float32, CPU).model
    used = set().union(*(spec.features() for spec in ours.layer_specs))
    assert used == FEATURES[name]
    assert ours.fused_decode.declined == frozenset(used - FusedCpuDecodeExecutor.SUPPORTED_FEATURES)
    seq = Seq(_tokens(9, random.Random(4)), 9, 6)
    driver = PagedDriver(ours, num_blocks=32, block_size=4, seed=1)
    executors = []
    while not seq.done:
        driver.step([(seq, len(seq.token_ids) - seq.num_computed)])
        executors.append(ours.last_executor)
    expected = "layerwise" if ours.fused_decode.declined else "fused_cpu_decode"
    assert executors[0] == "layerwise" and set(executors[1:]) == {expected}
    torch.testing.assert_close(torch.stack(seq.sampled_logits), hf_sampled_logits(hf, seq),
                               atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(request.param, tmp_path_factory.mktemp(request.param),
                               tokenizer=bundled_tokenizer, seed=7)
    ours = load_model(str(path), torch.float32, CPU).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@torch.inference_mode()
def test_gemma_local_and_global_layers_past_several_windows(gemma) -> None:
    """Window 16 on every other layer: prompts of 40 and 75 tokens (2.5 and 4.7 windows),
    prefilled in chunks of 5 and 16 mixed with the other's decodes, 20 greedy tokens: every
    logit and token is transformers' on the whole sequence."""
    ours, hf = gemma
    assert [spec.sliding_window for spec in ours.layer_specs] == [16, None, 16, None]
    rng = random.Random(11)
    seqs = [Seq(_tokens(n, rng), n, 20) for n in (40, 75)]
    PagedDriver(ours, num_blocks=96, block_size=4, seed=6).run(seqs, chunk_sizes=[5, 16])
    for seq in seqs:
        assert_matches_hf(hf, seq)


NEW_TOKENS = 10
ENGINE_CONFIGS = {
    # Chunks of 5 tokens; three prompts share 24 tokens.
    "chunked_prefix_cached": dict(block_size=4, max_num_batched_tokens=5),
    # 14 blocks of 4 tokens for five requests of up to 45 tokens: preemption. No drafts:
    # their slots would evict more of the cached prefix the test then looks up.
    "preemption": dict(block_size=4, max_num_batched_tokens=8, num_kv_blocks=14,
                       speculative_config=None),
    # n-gram drafts verified as rows of the target's forward.
    "ngram": dict(block_size=4, speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 1,
                                                    "prompt_lookup_max": 2}),
}


@pytest.fixture(scope="module")
def engine_case(family):
    """(name, path, prompts, transformers' greedy tokens from full forwards) per family."""
    name, path, hf = family
    rng = random.Random(2)
    shared = _tokens(24, rng)
    prompts = [_tokens(n, rng) for n in (5, 35)] + [shared + _tokens(k, rng) for k in (3, 9, 1)]
    return name, path, prompts, hf_greedy_full_forward(hf, prompts, NEW_TOKENS)


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_engine_greedy_equals_transformers(engine_case, config: str) -> None:
    name, path, prompts, reference = engine_case
    llm = LLM(str(path), dtype="float32", max_model_len=128, **ENGINE_CONFIGS[config])
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if config == "preemption":
        assert llm.core.scheduler.num_preemptions > 0
    # Again, the shared prefix and whole prompts now cached: hits, the same tokens.
    again = llm.generate(prompts[2:], greedy)
    assert [o.outputs[0].token_ids for o in again] == reference[2:]
    # The shared 24 tokens hit; under preemption a windowed group's 14-block pool may have
    # evicted the newest of the window's blocks, and the hit stops a block earlier.
    least = 20 if config == "preemption" and name.startswith("gemma") else 24
    assert all(o.num_cached_tokens >= least for o in again), [o.num_cached_tokens for o in again]
    assert_blocks_released(llm.core)


def test_soft_capped_attention_is_never_captured_in_a_cuda_graph(tiny_model_dirs) -> None:
    """Fail closed: Gemma 2's soft-capped attention loops over the step's requests on the
    host, so a CUDA graph would replay the captured step's loop: its decode steps run eagerly."""
    from aioengine.model.llama import make_kv_caches
    from aioengine.model.attention import build_attention_metadata
    from aioengine.worker.cuda_graphs import CUDAGraphRunner

    for name, safe in (("gemma2", False), ("gemma3", True)):
        model = load_model(str(tiny_model_dirs[name]), torch.float32, CPU).model
        assert model.cuda_graph_safe is safe
        caches = make_kv_caches(model.arch, 8, 4, torch.float32, CPU)
        runner = CUDAGraphRunner(model, caches, [1, 2], 32, 4, CPU, capture=False)
        meta, _ = build_attention_metadata([1], [3], [[1]], block_size=4, device=CPU)
        assert runner.can_run(meta) is safe
