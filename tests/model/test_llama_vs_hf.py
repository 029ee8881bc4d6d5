"""Our paged model vs transformers on tiny random-weight checkpoints of every supported arch."""
from __future__ import annotations

import random

import pytest
import torch
from paged_driver import PagedDriver, Seq
from tiny_models import TINY_ARCHS

from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model

CPU = torch.device("cpu")
# fp32 on both sides; the paged path only reorders float sums (|logits| ~ 10).
ATOL, RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module", params=TINY_ARCHS)
def models(request, tiny_model_dirs):
    """(ours, transformers') for one arch, both loaded from the same directory."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[request.param]
    ours = load_model(str(path), torch.float32, CPU)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours.model, hf


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@torch.inference_mode()
def _hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([token_ids]), use_cache=False).logits[0].float()


@torch.inference_mode()
def test_whole_prompt_prefill_matches_hf(models) -> None:
    ours, hf = models
    prompt = _tokens(37, seed=1)
    caches = make_kv_caches(ours.arch, num_blocks=16, block_size=4, dtype=torch.float32, device=CPU)
    meta, positions = build_attention_metadata([37], [37], [[9, 3, 14, 0, 7, 11, 2, 5, 12, 1]],
                                               block_size=4, device=CPU)
    logits = ours.compute_logits(ours(torch.tensor(prompt), positions, caches, meta))
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=RTOL)


def _check_against_hf(hf, seq: Seq) -> None:
    """Logits at every sampled position equal transformers' on the final token sequence, and
    each sampled token is transformers' argmax there, i.e. transformers' greedy output."""
    full = seq.token_ids
    ref = _hf_logits(hf, full[:-1])[seq.num_prompt - 1:]
    torch.testing.assert_close(torch.stack(seq.sampled_logits), ref, atol=ATOL, rtol=RTOL)
    assert seq.output_ids == ref.argmax(-1).tolist()


@pytest.mark.parametrize("cpu_kernels", ["on", "off"])
def test_chunked_and_batched_matches_hf(models, cpu_kernels: str, set_cpu_kernels) -> None:
    """Prompts split in chunks of varying size, mixed with decodes of other sequences in the
    same steps, on shuffled non-contiguous blocks; 16 greedy tokens each. With the C kernels
    (RoPE, decode attention) and with the torch paths they replace."""
    set_cpu_kernels("1" if cpu_kernels == "on" else "0")
    ours, hf = models
    seqs = [Seq(_tokens(n, seed=10 + n), num_prompt=n, max_new_tokens=16) for n in (23, 9, 31, 2)]
    PagedDriver(ours, num_blocks=64, block_size=4, seed=3).run(seqs, chunk_sizes=[7, 3, 16, 1, 5])
    for seq in seqs:
        _check_against_hf(hf, seq)


def test_greedy_tokens_equal_hf_generate(models) -> None:
    ours, hf = models
    prompt = _tokens(13, seed=5)
    seq = Seq(list(prompt), num_prompt=13, max_new_tokens=16)
    PagedDriver(ours, num_blocks=32, block_size=8, seed=4).run([seq], chunk_sizes=[5])
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert seq.output_ids == out[0, 13:].tolist()


def test_reads_blocks_written_in_the_same_step(models) -> None:
    """B shares A's first two blocks and runs in the step that writes them: each layer must
    write every request's K/V before any request attends."""
    ours, hf = models
    prefix = _tokens(8, seed=7)
    a = Seq(prefix + _tokens(4, seed=8), num_prompt=12, max_new_tokens=1)
    b = Seq(prefix + _tokens(5, seed=9), num_prompt=13, max_new_tokens=1)
    driver = PagedDriver(ours, num_blocks=16, block_size=4, seed=5)
    driver._ensure_blocks(a, 12)
    b.block_ids = a.block_ids[:2]
    b.num_computed = 8  # as after a prefix-cache hit on A's (not yet computed) blocks
    driver.step([(a, 12), (b, 5)])
    _check_against_hf(hf, a)
    _check_against_hf(hf, b)
