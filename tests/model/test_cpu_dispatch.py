"""The C kernels' run-time dispatch: every instruction-set build this CPU can run, forced in
turn, computes the gemv in all three weight formats as a float64 numpy reference does, and
the fused decode of a bf16 and an int8 model as the layer-by-layer path does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_decode
from aioengine.model.layers import quantize_int8_rows

VARIANTS = cpu_kernels.supported_variants()



def _bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float32."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k", [64, 100, 576])  # 100: a tail past the vector loops
def test_gemv_formats_match_numpy(variant: str, rows: int, k: int) -> None:
    rng = np.random.default_rng(rows * 1000 + k)
    n = 300
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    xt, wt, bt = map(torch.from_numpy, (x, w, bias))

    out = cpu_kernels.gemv(xt, wt, bt)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)

    # int8, weight-only: x unrounded, (x . q) * s + b.
    q, s = quantize_int8_rows(wt)
    out = cpu_kernels.gemv(xt, q, bt, s)
    ref = (x.astype(np.float64) @ q.numpy().astype(np.float64).T) * s.numpy() + bias
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)
    # ... and the quantization itself is within half a step of the weights. (W8A8 has no
    # row-major kernel: the packed GEMM's bits, tests/model/test_cpu_gemm_w8a8.py.)
    assert np.all(np.abs(q.numpy() * s.numpy()[:, None] - w) <= s.numpy()[:, None] / 2 + 1e-7)

    # bf16: x and w rounded to bf16, float sums, the result rounded to bf16. Float32 sums
    # in another order can round the other way at a bf16 boundary: one bf16 ulp at most.
    b16 = _bf16_round(bias)
    out = cpu_kernels.gemv(xt, wt.bfloat16(), torch.from_numpy(b16))
    exact = _bf16_round(x).astype(np.float64) @ _bf16_round(w).astype(np.float64).T + b16
    ulp = np.abs(exact) * 2.0 ** -7 + 1e-30
    assert np.all(np.abs(out.numpy() - exact) <= ulp)
    assert np.mean(out.numpy() == _bf16_round(exact.astype(np.float32))) > 0.97
    assert torch.equal(out, out.bfloat16().float())  # bf16 values


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
    """A bf16 LM head decides in float32: bf16 logits from the gemv (few rows) or oneDNN
    (many), each row's top candidates recomputed as float32 sums, alike in both."""
    from aioengine.model.layers import LOGITS_REFINE_TOP, Linear, lm_head_logits

    torch.manual_seed(0)
    head = Linear(64, 5000, False, torch.float32, torch.device("cpu"))
    head.weight.copy_(torch.randn(5000, 64))
    head.convert("bfloat16")
    x = torch.randn(9, 64) * 3
    exact = x.bfloat16().double() @ head.weight.double().t()
    many = lm_head_logits(x, head)  # 9 rows: oneDNN, refined
    few = torch.cat([lm_head_logits(x[i:i + 2], head)[:1] for i in range(9)])  # the gemv
    top = exact.topk(LOGITS_REFINE_TOP, dim=-1).indices
    for got in (many, few):
        torch.testing.assert_close(got.gather(1, top).double(), exact.gather(1, top),
                                   rtol=1e-5, atol=1e-4)
    assert (many == few).float().mean() > 0.99  # the tail: bf16 values, rarely an ulp apart
    assert not torch.equal(many, many.bfloat16().float())  # not all bf16 values
    assert torch.equal(many.argmax(-1), exact.argmax(-1)) and torch.equal(few.argmax(-1), exact.argmax(-1))
