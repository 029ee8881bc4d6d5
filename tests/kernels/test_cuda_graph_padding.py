"""CUDA graphs' padded decode steps, on the CPU: the CUDAGraphRunner's static buffers run
eagerly (capture=False) with the Triton backend under the interpreter, so everything but
the graph itself (padding to a captured size, the static metadata, slot -1 rows writing
nothing) is checked against a plain eager step."""
from __future__ import annotations

import random

import pytest
import torch

from aioengine import LLM, SamplingParams
from aioengine.model.attention import build_attention_metadata
from aioengine.worker.cuda_graphs import CUDAGraphRunner, default_capture_sizes, padded_size

from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny_llama"), seed=3)


def test_capture_sizes_and_padding() -> None:
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = default_capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 64, 65)] == [
        1, 4, 8, 16, 24, 64, None]


def test_a_padded_decode_step_equals_the_eager_one(model_dir, device) -> None:
    llm = LLM(str(model_dir), attention_backend="triton", dtype="float32", device=device.type,
              max_model_len=64, num_kv_blocks=16)
    runner = llm.core.runner
    rng = random.Random(1)
    # 3 decodes (padded to 4) over block tables with holes and seq lens off the block size.
    seq_lens, tables = [5, 19, 33], [[7], [2, 9], [11, 3, 14]]
    for cache in runner.kv_caches:
        cache.normal_()
    meta, positions = build_attention_metadata([1, 1, 1], seq_lens, tables, 16, device)
    input_ids = torch.tensor([rng.randrange(100, 40000) for _ in range(3)], device=device)
    before = [c.clone() for c in runner.kv_caches]
    eager = runner.model(input_ids, positions, runner.kv_caches, meta)
    written = [c.clone() for c in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, before):
        cache.copy_(saved)
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, [1, 2, 4, 8], 64, 16, device,
                             capture=False)
    assert graphs.can_run(meta)
    called = []
    padded = graphs.run(input_ids, positions, meta, before_layers=lambda: called.append(1))
    assert called == [1] and padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    # The padding rows (slot -1) wrote no K/V: the caches equal the eager step's exactly.
    for cache, expected in zip(runner.kv_caches, written):
        assert torch.equal(cache, expected)
    # What the graphs cannot hold runs eagerly.
    prefill, _ = build_attention_metadata([4], [4], [[1]], 16, device)
    big, _ = build_attention_metadata([1] * 9, [3] * 9, [[i] for i in range(9)], 16, device)
    assert not graphs.can_run(prefill) and not graphs.can_run(big)


def test_the_engine_with_padded_decode_steps_keeps_greedy_tokens(model_dir, device) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 20, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    settings = dict(dtype="float32", device=device.type, max_model_len=64, num_kv_blocks=24)
    expected = [o.outputs[0].token_ids
                for o in LLM(str(model_dir), **settings).generate(prompts, params)]
    llm = LLM(str(model_dir), attention_backend="triton", **settings)
    llm.core.runner.capture_cuda_graphs([1, 2, 4], 64, capture=False)
    replays = []
    run = llm.core.runner.cuda_graphs.run
    llm.core.runner.cuda_graphs.run = lambda *a, **k: replays.append(1) or run(*a, **k)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert len(replays) >= 5  # the decode steps went through the padded buffers
