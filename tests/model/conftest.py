"""Fixtures for the model tests: tiny checkpoints on disk, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import FAMILY_ARCHS, TINY_ARCHS, make_tiny_model_dir

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_build, cpu_decode


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory, bundled_tokenizer) -> dict[str, Path]:
    """arch -> directory with config.json, model.safetensors and the bundled tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model_dir(arch, root / arch, tokenizer=bundled_tokenizer)
            for arch in TINY_ARCHS + FAMILY_ARCHS}


@pytest.fixture
def set_cpu_kernels(monkeypatch: pytest.MonkeyPatch):
    """set_cpu_kernels("0" | "1"): AIOENGINE_CPU_KERNELS for this test. The kernels read the
    variable once, so each change is followed by a reset, and so is the test's end (before
    monkeypatch restores the variable; the next use reads the restored value)."""
    def set_value(value: str) -> None:
        monkeypatch.setenv("AIOENGINE_CPU_KERNELS", value)
        cpu_kernels.reset()

    yield set_value
    cpu_kernels.reset()


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token counts of the llama_decode calls that ran the decoder layers (a spy: each
    call goes through to the kernel)."""
    calls: list[int] = []
    real = cpu_decode.llama_decode

    def spy(x, *args, **kwargs):
        done = real(x, *args, **kwargs)
        if done:
            calls.append(x.shape[0])
        return done

    monkeypatch.setattr(cpu_decode, "llama_decode", spy)
    return calls


@pytest.fixture(scope="session")
def every_build() -> list[str]:
    """Every kernel build this CPU runs, compiled once up front two at a time (one by one,
    as each test first loads it, they took ~80 s of a 2-core CI run)."""
    names = cpu_kernels.supported_variants()
    cpu_build.build_variants(names)  # a build that fails says why when a test loads it
    return names


@pytest.fixture(params=cpu_kernels.supported_variants())
def variant(request, every_build):
    """Each kernel build this CPU can run (avx2, avx512, avx512_bf16, ...), forced in turn."""
    cpu_kernels.use_variant(request.param)
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    assert cpu_kernels.variant() == request.param
    yield request.param
    cpu_kernels.use_variant(None)


@pytest.fixture
def one_thread():
    """one_thread(fn): fn() run with one torch thread (the kernels' OpenMP team), the
    thread count restored after."""
    def run(fn):
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            return fn()
        finally:
            torch.set_num_threads(threads)
    return run
