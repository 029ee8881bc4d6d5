"""A tiny random-weight Llama for engine tests, and transformers' greedy tokens on it."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from aioengine.engine.core import EngineCore

from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny_llama"), seed=3)


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """Random-token prompts of 3..70 tokens (several blocks, partial last blocks), plus two
    that share a 40-token prefix so prefix caching has something to hit."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 17, 33, 70, 9, 48)]
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    prompts += [shared + [rng.randrange(100, 40000) for _ in range(k)] for k in (5, 11)]
    return prompts


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    """transformers' float32 model of a checkpoint directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    model = load_hf_model(model_dir)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def hf_greedy_full_forward(model: torch.nn.Module, prompts: list[list[int]],
                           max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, every token from a forward of the
    whole sequence so far (no KV cache)."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
    return outs


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(tiny_llama_dir, tiny_prompts, 12)


def assert_blocks_released(core: EngineCore) -> None:
    """Every block is free or cached with ref_cnt == 0, and the bookkeeping is sound."""
    kv = core.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, (
        f"{kv.num_blocks - kv.num_free_blocks} blocks still referenced")
    assert not core.scheduler.running and not core.scheduler.waiting
