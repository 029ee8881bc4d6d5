"""The bundled SmolLM2-135M-Instruct through the whole engine, against transformers
reading the same GGUF file."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from aioengine import LLM, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256, dtype="float32")  # exact against transformers in fp32


@pytest.fixture(scope="module")
def hf_model(bundled_gguf_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(bundled_gguf_path), gguf_file=os.path.basename(bundled_gguf_path),
        dtype=torch.float32).eval()


def test_greedy_chat_tokens_equal_transformers(llm: LLM, hf_model) -> None:
    messages = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate(messages, params)
    for msgs, out in zip(messages, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=24, pad_token_id=llm.tokenizer.eos_token_id)
        expected = ref[0, ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        assert got == expected[:len(got)], msgs
        # We stop at EOS exactly where transformers does (it pads after EOS).
        assert len(got) == 24 or got[-1] in llm.core.eos_token_ids


def test_the_capital_of_france_is_paris(llm: LLM) -> None:
    out = llm.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                       SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate(["The capital of France is"], params)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the best
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry and len(entry) <= 3


def test_cli_generate_streams_the_answer() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aioengine.cli", "generate", "--chat", "--num-kv-blocks", "64",
         "--max-tokens", "16", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
