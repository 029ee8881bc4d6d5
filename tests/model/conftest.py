"""Fixtures for the model tests: tiny checkpoints on disk, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import TINY_ARCHS, make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory, bundled_tokenizer) -> dict[str, Path]:
    """arch -> directory with config.json, model.safetensors and the bundled tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model_dir(arch, root / arch, tokenizer=bundled_tokenizer)
            for arch in TINY_ARCHS}
