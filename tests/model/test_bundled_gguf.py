"""The bundled SmolLM2-135M-Instruct (Q4_1 GGUF): ours vs transformers reading the same file."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from paged_driver import PagedDriver, Seq

from aioengine.model.attention import build_attention_metadata
from aioengine.model.gguf_loader import FastGGUFReader
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model
from tests.float_error import assert_as_exact_as

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def ours():
    return load_model(None, torch.float32, CPU)


@pytest.fixture(scope="module")
def hf_model(bundled_gguf_path: str, ours):
    """transformers' own GGUF reading: config, dequantization, q/k un-permutation.

    `from_pretrained(dir, gguf_file=...)` runs this same code; it is spelled out here for
    two speed-ups that change no result (seconds on 2 cores): gguf's name map is memoised
    (transformers rebuilds it for each of ~400 modules), and the file is parsed by our
    FastGGUFReader (gguf's own parser over a plain-array view of the file).
    """
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", FastGGUFReader)
        # The weight-name mapping needs a model of the right shape; a meta-device one is free.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(ours.hf_config)
        parsed = load_gguf_checkpoint(bundled_gguf_path, return_tensors=True,
                                      model_to_load=skeleton)
    # The reference's config is transformers' reading of the metadata, not ours.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**parsed["config"]),
                                             dtype=torch.float32)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return model.eval()


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_config_read_from_metadata(ours) -> None:
    arch = ours.arch
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.rope_theta, arch.tie_word_embeddings) == (49152, 100000.0, True)
    assert ours.max_model_len == 8192 and arch.eos_token_ids == [2]
    assert ours.tokenizer.eos_token == "<|im_end|>"


@torch.inference_mode()
def test_prefill_logits_match_transformers(ours, hf_model) -> None:
    """Against transformers in float64 (the exact logits, for this purpose): ours are as
    close as transformers' own float32 run (tests/float_error.py). Two correct float32 models
    differ by ~1e-4 here (summation order over 30 layers), so a fixed tolerance against
    transformers' float32 logits would measure rounding luck rather than correctness."""
    ids = _chat_ids(ours.tokenizer, PROMPTS[0])
    caches = make_kv_caches(ours.arch, 8, 16, torch.float32, CPU)
    meta, pos = build_attention_metadata([len(ids)], [len(ids)], [[6, 2, 4, 0]], 16, CPU)
    logits = ours.model.compute_logits(ours.model(torch.tensor(ids), pos, caches, meta))
    ref = hf_model(torch.tensor([ids]), use_cache=False).logits[0]
    exact = copy.deepcopy(hf_model).double()(torch.tensor([ids]), use_cache=False).logits[0]
    assert_as_exact_as(logits, ref, exact)
    torch.testing.assert_close(logits, ref, atol=5e-4, rtol=1e-5)


def test_greedy_chat_matches_transformers(ours, hf_model) -> None:
    """Three chat prompts batched and chunked together; 16 greedy tokens each."""
    seqs = [Seq(ids, num_prompt=len(ids), max_new_tokens=16)
            for ids in (_chat_ids(ours.tokenizer, p) for p in PROMPTS)]
    PagedDriver(ours.model, num_blocks=32, block_size=16, seed=1).run(seqs, chunk_sizes=[16, 7])
    with torch.inference_mode():
        for seq in seqs:
            prompt = seq.token_ids[:seq.num_prompt]
            # An explicit mask: the chat template holds <|im_end|>, which is also the pad id.
            out = hf_model.generate(torch.tensor([prompt]),
                                    attention_mask=torch.ones(1, len(prompt)),
                                    max_new_tokens=16, do_sample=False, eos_token_id=None,
                                    pad_token_id=2)
            assert seq.output_ids == out[0, seq.num_prompt:].tolist()
    assert "Paris" in ours.tokenizer.decode(seqs[0].output_ids)
