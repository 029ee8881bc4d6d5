"""The Triton kernels' tests: natively on CUDA, else under Triton's interpreter on the CPU.

TRITON_INTERPRET must be set when aioengine.kernels.triton is first imported (triton.jit
reads it when the kernels are defined): this module imports the kernels with it set, at
collection, ahead of the test modules, then restores the environment so that tests in other
folders see the session's own; the tests here run with it set (select_attention_backend
reads it). The interpreter handles fp32 and fp16, not bf16.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
if INTERPRETED and "aioengine.kernels.triton" not in sys.modules:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import aioengine.kernels.triton  # noqa: F401,E402  (defines the kernels interpreted)
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
# One device per run: the interpreter takes CPU tensors, compiled kernels CUDA ones.
DEVICES = ("cpu",) if INTERPRETED else ("cuda",)
DTYPES = (torch.float32, torch.float16)


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 fp32_tol: float = 2e-5, fp16_tol: float = 2e-3) -> None:
    """Same shape and dtype, no NaN, and within fp32's or fp16's tolerance (atol = rtol)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "NaN in the kernel's output"
    tol = fp32_tol if dtype == torch.float32 else fp16_tol
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)
