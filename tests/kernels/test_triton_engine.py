"""The whole engine on the Triton attention backend (under the interpreter on the CPU):
greedy tokens equal the torch backend's on a tiny random Llama in fp32."""
from __future__ import annotations

import random

import pytest

from aioengine import LLM, SamplingParams
from aioengine.model.triton_attention import TritonAttentionBackend

from tests.tiny_models import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_greedy_tokens_equal_the_torch_backend(tmp_path_factory: pytest.TempPathFactory,
                                               device) -> None:
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny_llama"), seed=3)
    rng = random.Random(0)
    # 37 tokens over a 32-token budget: chunked prefill, a chunk after cached context, and
    # steps that mix it with the other requests' decodes.
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 20, 37)]
    settings = dict(dtype="float32", device=device.type, max_model_len=64,
                    max_num_batched_tokens=32, num_kv_blocks=24)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), attention_backend=backend, **settings)
        assert (type(llm.core.loaded.model.attn_backend) is TritonAttentionBackend) == (
            backend == "triton")
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(len(t) == 5 for t in tokens["triton"])
    assert tokens["triton"] == tokens["torch"]
