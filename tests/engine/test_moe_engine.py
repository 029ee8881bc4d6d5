"""Mixture-of-experts models through the engine (LLM): greedy tokens equal transformers'
under chunked prefill, prefix caching (with hits) and batching, every block released; the
fused C decode executor never runs a step of a model with sparse layers."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.kernels import cpu_decode

from tests.engine.conftest import assert_blocks_released, hf_greedy
from tests.moe_models import make_tiny_moe_dir

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts of 3..45 tokens, three sharing a 24-token prefix."""
    rng = random.Random(2)
    out = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 17, 45)]
    shared = [rng.randrange(100, 40000) for _ in range(24)]
    return out + [shared + [rng.randrange(100, 40000) for _ in range(k)] for k in (2, 7, 13)]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_case(request, tmp_path_factory: pytest.TempPathFactory,
             prompts: list[list[int]]) -> tuple[Path, list[list[int]]]:
    path = make_tiny_moe_dir(request.param, tmp_path_factory.mktemp(request.param), seed=11)
    return path, hf_greedy(path, prompts, NEW_TOKENS)


CONFIGS = {
    "chunks_of_5": dict(block_size=4, max_num_batched_tokens=5),
    "chunks_of_16": dict(block_size=4, max_num_batched_tokens=16, async_scheduling=True),
    "no_prefix_caching": dict(block_size=8, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_greedy_matches_transformers(name: str, moe_case, prompts, monkeypatch) -> None:
    path, reference = moe_case
    fused: list[int] = []
    real = cpu_decode.llama_decode
    monkeypatch.setattr(cpu_decode, "llama_decode",
                        lambda x, *a, **k: fused.append(x.shape[0]) or real(x, *a, **k))
    llm = LLM(str(path), dtype="float32", max_model_len=128, **CONFIGS[name])
    assert "moe" in llm.core.runner.model.fused_decode.declined
    outs = llm.generate(prompts[:3], GREEDY)
    # The shared-prefix prompts after the first of them finished: prefix-cache hits.
    outs += llm.generate(prompts[3:4], GREEDY) + llm.generate(prompts[4:], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if CONFIGS[name].get("enable_prefix_caching", True):
        assert all(o.num_cached_tokens == 24 for o in outs[4:])
    assert fused == []
    assert_blocks_released(llm.core)


def test_lora_is_refused_for_moe_models(tmp_path: Path) -> None:
    """Fail closed: LoRA would wrap the attention only, not the experts."""
    from aioengine.errors import ConfigError

    path = make_tiny_moe_dir("mixtral", tmp_path / "m", seed=3)
    with pytest.raises(ConfigError, match="MixtralForCausalLM: LoRA adapters are not supported"):
        LLM(str(path), dtype="float32", enable_lora=True, max_model_len=64)
