"""The C kernels' run-time dispatch: every instruction-set build this CPU can run, forced in
turn, computes the fused decode of a bf16, an int8 and a w8a8 model as the layer-by-layer
path does (the packed GEMM in every build: tests/model/test_cpu_gemm*.py)."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_decode

VARIANTS = cpu_kernels.supported_variants()


def test_an_unknown_or_unsupported_build_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown CPU kernel variant"):
        cpu_kernels.use_variant("avx9000")
    unsupported = [v for v, _, _ in cpu_kernels.ISA_VARIANTS if v not in VARIANTS]
    for name in unsupported:
        with pytest.raises(RuntimeError, match="cannot run"):
            cpu_kernels.use_variant(name)


def test_forcing_a_build_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CPU_ISA", VARIANTS[-1])
    cpu_kernels.use_variant(None)
    try:
        assert cpu_kernels.load() is not None and cpu_kernels.variant() == VARIANTS[-1]
    finally:
        monkeypatch.delenv("AIOENGINE_CPU_ISA")
        cpu_kernels.use_variant(None)
    assert cpu_kernels.load() is not None and cpu_kernels.variant() == VARIANTS[0]


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "w8a8"])
def test_fused_decode_in_every_build(variant: str, storage: str, tiny_model_dirs,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode step of three requests, fused vs layer by layer, under each build."""
    from test_fused_decode import STORAGES, _decode, _prefilled

    from aioengine.model.loader import load_model

    dtype, quantization, tol = STORAGES[storage]
    model = load_model(str(tiny_model_dirs["qwen2"]), dtype, torch.device("cpu"),
                       quantization).model
    case = _prefilled(model, [5, 19, 2])
    calls, real = [], cpu_decode.llama_decode
    monkeypatch.setattr(cpu_decode, "llama_decode",
                        lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    ours, ours_caches = _decode(model, True, *case)
    assert calls == [True]  # the fused kernel ran the step
    ref, ref_caches = _decode(model, False, *case)
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    for a, b in zip(ours_caches, ref_caches):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_bf16_logits_are_float32_sums_in_both_paths() -> None:
    """An unpacked bf16 LM head decides in float32: bf16 logits from oneDNN, for few rows
    or many, each row's top candidates recomputed as float32 sums, alike in both."""
    from aioengine.model.layers import LOGITS_REFINE_TOP, Linear, lm_head_logits

    torch.manual_seed(0)
    head = Linear(64, 5000, False, torch.float32, torch.device("cpu"))
    head.weight.copy_(torch.randn(5000, 64))
    head.convert("bfloat16")
    x = torch.randn(9, 64) * 3
    exact = x.bfloat16().double() @ head.weight.double().t()
    many = lm_head_logits(x, head)  # 9 rows: oneDNN, refined
    few = torch.cat([lm_head_logits(x[i:i + 2], head)[:1] for i in range(9)])  # 2 rows
    top = exact.topk(LOGITS_REFINE_TOP, dim=-1).indices
    for got in (many, few):
        torch.testing.assert_close(got.gather(1, top).double(), exact.gather(1, top),
                                   rtol=1e-5, atol=1e-4)
    assert (many == few).float().mean() > 0.99  # the tail: bf16 values, rarely an ulp apart
    assert not torch.equal(many, many.bfloat16().float())  # not all bf16 values
    assert torch.equal(many.argmax(-1), exact.argmax(-1)) and torch.equal(few.argmax(-1), exact.argmax(-1))
