"""Our paged model against transformers on the same checkpoint: the checks the model tests
share. A PagedDriver run records each sequence's sampled logits; transformers' reference is
one forward of the final sequence, no cache.

    assert_matches_hf(hf, seq)   # logits within ATOL/RTOL, tokens = transformers' greedy
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from paged_driver import PagedDriver, Seq

# fp32 on both sides; the paged path only reorders float sums (|logits| ~ 10).
ATOL, RTOL = 1e-4, 1e-5


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def prefill_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Our model's logits at every position of one prefill of `tokens` (<= 48), in a paged
    fp32 cache of 16 blocks of 8 with a scattered block table."""
    from aioengine.model.attention import build_attention_metadata
    from aioengine.model.llama import make_kv_caches

    cpu = torch.device("cpu")
    caches = make_kv_caches(model.arch, 16, 8, torch.float32, cpu)
    n = len(tokens)
    meta, pos = build_attention_metadata([n], [n], [[5, 1, 9, 3, 0, 12]], 8, cpu)
    return model.compute_logits(model(torch.tensor(tokens), pos, caches, meta))


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of `token_ids`."""
    return hf(torch.tensor([token_ids]), use_cache=False).logits[0].float()


def hf_sampled_logits(hf: torch.nn.Module, seq: Seq) -> torch.Tensor:
    """transformers' logits at each position `seq` sampled at: [num outputs, vocab]."""
    return hf_logits(hf, seq.token_ids[:-1])[seq.num_prompt - 1:]


def assert_matches_hf(hf: torch.nn.Module, seq: Seq, atol: float = ATOL,
                      rtol: float = RTOL) -> None:
    """Logits at every sampled position equal transformers' on the final token sequence, and
    each sampled token is transformers' argmax there, i.e. transformers' greedy output."""
    ref = hf_sampled_logits(hf, seq)
    torch.testing.assert_close(torch.stack(seq.sampled_logits), ref, atol=atol, rtol=rtol)
    assert seq.output_ids == ref.argmax(-1).tolist()


def assert_greedy_equals_hf_generate(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    """A 13-token prompt prefilled in chunks of 5, then 16 greedy tokens: transformers'
    `generate` gives the same tokens."""
    prompt = random_tokens(13, seed=5)
    seq = Seq(list(prompt), num_prompt=13, max_new_tokens=16)
    PagedDriver(ours, num_blocks=32, block_size=8, seed=4).run([seq], chunk_sizes=[5])
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert seq.output_ids == out[0, 13:].tolist()


def reduced_precision_errors(ours: torch.nn.Module, hf32: torch.nn.Module,
                             hf16: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs three prompts (23, 9, 31 tokens; chunked, mixed with decodes) for 12 greedy
    tokens on `ours` (a reduced-precision model) and returns (ours - hf32, hf16 - hf32): the
    logit errors of ours and of transformers' bf16 against transformers' float32, at every
    generated position along our own greedy path, [positions, vocab] each. Also checks that
    each of our tokens is our logits' argmax."""
    seqs = [Seq(random_tokens(n, seed=20 + n), num_prompt=n, max_new_tokens=12)
            for n in (23, 9, 31)]
    PagedDriver(ours, num_blocks=64, block_size=4, seed=3).run(seqs, chunk_sizes=[7, 16, 3])
    errors, hf_errors = [], []
    for seq in seqs:
        ref = hf_sampled_logits(hf32, seq)
        errors.append(torch.stack(seq.sampled_logits) - ref)
        hf_errors.append(hf_sampled_logits(hf16, seq) - ref)
        assert seq.output_ids == torch.stack(seq.sampled_logits).argmax(-1).tolist()
    return torch.cat(errors), torch.cat(hf_errors)
