"""Fixtures shared by all test folders."""
from __future__ import annotations

import os

import pytest
import torch

from aioengine.model.default import bundled_model_path


@pytest.fixture(scope="session")
def bundled_gguf_path() -> str:
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_gguf_path: str):
    """The bundled model's tokenizer, as transformers reads it from the GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(bundled_gguf_path), gguf_file=os.path.basename(bundled_gguf_path))


@pytest.fixture
def bench_threads(monkeypatch: pytest.MonkeyPatch):
    """The benchmark sets torch's thread count and AIOENGINE_CPU_THREADS; restore both."""
    monkeypatch.setenv("AIOENGINE_CPU_THREADS", "0")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
