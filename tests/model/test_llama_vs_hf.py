"""Our paged model vs transformers on tiny random-weight checkpoints of every supported arch
(TINY_ARCHS: the Llama family; FAMILY_ARCHS: Gemma 2/3, Phi-3, OLMo 2, Granite, SmolLM3, YaRN)."""
from __future__ import annotations

import pytest
import torch
from hf_compare import (ATOL, RTOL, assert_greedy_equals_hf_generate, assert_matches_hf,
                        hf_logits, load_hf, random_tokens, reduced_precision_errors)
from paged_driver import PagedDriver, Seq
from tiny_models import FAMILY_ARCHS, TINY_ARCHS

from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=TINY_ARCHS + FAMILY_ARCHS)
def models(request, tiny_model_dirs):
    """(ours, transformers') for one arch, both loaded from the same directory."""
    path = tiny_model_dirs[request.param]
    return load_model(str(path), torch.float32, CPU).model, load_hf(path)


@torch.inference_mode()
def test_whole_prompt_prefill_matches_hf(models) -> None:
    ours, hf = models
    prompt = random_tokens(37, seed=1)
    caches = make_kv_caches(ours.arch, num_blocks=16, block_size=4, dtype=torch.float32, device=CPU)
    meta, positions = build_attention_metadata([37], [37], [[9, 3, 14, 0, 7, 11, 2, 5, 12, 1]],
                                               block_size=4, device=CPU)
    logits = ours.compute_logits(ours(torch.tensor(prompt), positions, caches, meta))
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cpu_kernels", ["on", "off"])
def test_chunked_and_batched_matches_hf(models, cpu_kernels: str, set_cpu_kernels) -> None:
    """Prompts split in chunks of varying size, mixed with decodes of other sequences in the
    same steps, on shuffled non-contiguous blocks; 16 greedy tokens each. With the C kernels
    (RoPE, decode attention) and with the torch paths they replace."""
    set_cpu_kernels("1" if cpu_kernels == "on" else "0")
    ours, hf = models
    seqs = [Seq(random_tokens(n, seed=10 + n), num_prompt=n, max_new_tokens=16)
            for n in (23, 9, 31, 2)]
    PagedDriver(ours, num_blocks=64, block_size=4, seed=3).run(seqs, chunk_sizes=[7, 3, 16, 1, 5])
    for seq in seqs:
        assert_matches_hf(hf, seq)


def test_greedy_tokens_equal_hf_generate(models) -> None:
    assert_greedy_equals_hf_generate(*models)


def test_reads_blocks_written_in_the_same_step(models) -> None:
    """B shares A's first two blocks and runs in the step that writes them: each layer must
    write every request's K/V before any request attends."""
    ours, hf = models
    prefix = random_tokens(8, seed=7)
    a = Seq(prefix + random_tokens(4, seed=8), num_prompt=12, max_new_tokens=1)
    b = Seq(prefix + random_tokens(5, seed=9), num_prompt=13, max_new_tokens=1)
    driver = PagedDriver(ours, num_blocks=16, block_size=4, seed=5)
    driver._ensure_blocks(a, 12)
    b.block_ids = a.block_ids[:2]
    b.num_computed = 8  # as after a prefix-cache hit on A's (not yet computed) blocks
    driver.step([(a, 12), (b, 5)])
    assert_matches_hf(hf, a)
    assert_matches_hf(hf, b)


# ---- bf16 and int8 weights -----------------------------------------------------------
#
# The rule, since neither side is exact: our bf16 (bf16 weights, float32 activations, every
# projection a bf16 matmul with float32 sums) must be at least as close to the float32
# reference as transformers' own bf16 model is: RMS logit error (over the vocabulary, at
# every generated position, along our own greedy path, prefill chunked and mixed with
# decodes) no larger than transformers' bf16 on the same tokens (measured: 0.68-0.91x on
# these five archs). int8 (per-row weight-only) has no transformers counterpart: its RMS
# error must stay within 3x that of transformers' bf16 (measured 1.7-1.9x), w8a8 (activations
# quantized per token too) within 4x (measured 2.1-2.6x). Greedy identity
# is not asserted for either: on these random tiny models the reference's median top-2
# margin (~0.2) is below bf16's largest logit error (~0.25), and any "identical where the
# margin exceeds our error" rule follows from the logit bound itself. Greedy agreement on
# the real model is measured by `aioengine bench accuracy` (docs/benchmarks.md).


@pytest.fixture(scope="module", params=TINY_ARCHS + FAMILY_ARCHS)
def reduced_models(request, tiny_model_dirs):
    """({storage: ours}, transformers fp32, transformers bf16) for one arch."""
    path = tiny_model_dirs[request.param]
    ours = {"bfloat16": load_model(str(path), torch.bfloat16, CPU).model,
            "int8": load_model(str(path), torch.float32, CPU, quantization="int8").model,
            "w8a8": load_model(str(path), torch.float32, CPU, quantization="w8a8").model}
    return ours, load_hf(path), load_hf(path, torch.bfloat16)


@pytest.mark.parametrize("which,bound", [("bfloat16", 1.0), ("int8", 3.0), ("w8a8", 4.0)])
def test_reduced_precision_against_transformers(reduced_models, which: str, bound: float) -> None:
    models, hf32, hf16 = reduced_models
    errors, hf_errors = reduced_precision_errors(models[which], hf32, hf16)
    rms = errors.pow(2).mean().sqrt().item()
    hf_rms = hf_errors.pow(2).mean().sqrt().item()
    assert 0 < rms <= bound * hf_rms, f"{which}: RMS logit error {rms:.4f}, transformers bf16 {hf_rms:.4f}"
