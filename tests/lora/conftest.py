"""A tiny Llama, three random PEFT adapters for it, and transformers + peft greedy tokens
of a few prompts under each (the reference of the engine-level LoRA tests)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.lora_adapters import make_peft_adapter, peft_model
from tests.tiny_models import make_tiny_model_dir

NEW_TOKENS = 10
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "a1": dict(r=4, target_modules=["q_proj", "v_proj", "down_proj"], seed=11),
    "a2": dict(r=8, target_modules=ALL_MODULES, seed=12, use_rslora=True),
    "a3": dict(r=2, target_modules=["gate_proj", "up_proj", "o_proj", "k_proj"], seed=13),
}


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="session")
def lora_model_dir(lora_root: Path) -> Path:
    return make_tiny_model_dir("llama", lora_root / "model", seed=3)


@pytest.fixture(scope="session")
def adapter_dirs(lora_model_dir: Path, lora_root: Path) -> dict[str, Path]:
    return {name: make_peft_adapter(lora_model_dir, lora_root / name, **kw)
            for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="session")
def lora_prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(24)]  # a prefix-cache hit, if allowed
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 19, 40)]
    return prompts + [shared + [rng.randrange(100, 40000) for _ in range(k)] for k in (3, 9)]


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def peft_greedy(lora_model_dir: Path, adapter_dirs: dict[str, Path],
                lora_prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Adapter name (None: the base model) -> greedy tokens of every prompt."""
    out = {}
    for name in [None, *adapter_dirs]:
        model = peft_model(lora_model_dir, None if name is None else adapter_dirs[name])
        out[name] = [greedy(model, p, NEW_TOKENS) for p in lora_prompts]
    return out
