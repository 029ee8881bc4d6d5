"""The one-call decode of kernels/cpu/llama_decode.c against the layer-by-layer forward it
replaces for decode steps of a few requests (LlamaForCausalLM.use_fused_decode)."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch
from tiny_models import TINY_ARCHS

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_decode, cpu_gemm
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model

CPU = torch.device("cpu")
BLOCK_SIZE = 4
PROJECTIONS = ("qkv", "o", "gate_up", "down")


# Weight storage -> (dtype, quantization) and the tolerance of fused vs layer path: the same
# arithmetic up to summation order, except where bf16 rounds: an unpacked bf16 weight's
# torch path (oneDNN) rounds each projection's x and output (2^-8 relative), and the
# AVX512-BF16 build's packed GEMM rounds x where the torch fallback (kernels off) does not,
# so a last-bit difference can become a bf16 ulp, amplified by the tiny random models'
# layers; w8a8 quantizes each projection's input, so one can become a quantization step
# (the projections themselves are bit-exact: tests/model/test_cpu_gemm_w8a8.py).
STORAGES = {"float32": (torch.float32, None, 1e-5), "bfloat16": (torch.bfloat16, None, 6e-2),
            "int8": (torch.float32, "int8", 1e-4), "w8a8": (torch.float32, "w8a8", 3e-2)}


@pytest.fixture(scope="module", params=[(a, s) for a in TINY_ARCHS for s in STORAGES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, tiny_model_dirs):
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    arch, storage = request.param
    dtype, quantization, tol = STORAGES[storage]
    loaded = load_model(str(tiny_model_dirs[arch]), dtype, CPU, quantization).model
    loaded.test_tolerance = tol
    return loaded


def _prefilled(model, seq_lens: list[int], seed: int = 0, vocab: int = 49152,
               kv_dtype: torch.dtype = torch.float32):
    """KV caches of `kv_dtype` holding random prompts of seq_lens - 1 tokens
    (layer-by-layer prefill) on shuffled blocks, and the decode step's (input_ids,
    positions, meta)."""
    rng = random.Random(seed)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 4
    caches = make_kv_caches(model.arch, num_blocks, BLOCK_SIZE, kv_dtype, CPU)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // BLOCK_SIZE))] for s in seq_lens]
    prompts = [[rng.randrange(3, vocab) for _ in range(s)] for s in seq_lens]
    context = [(s - 1, table, p[:-1]) for s, table, p in zip(seq_lens, tables, prompts) if s > 1]
    if context:
        with torch.inference_mode():
            meta, positions = build_attention_metadata(
                [n for n, _, _ in context], [n for n, _, _ in context],
                [table for _, table, _ in context], BLOCK_SIZE, CPU)
            model(torch.tensor([t for _, _, p in context for t in p]), positions, caches, meta)
    meta, positions = build_attention_metadata([1] * len(seq_lens), seq_lens, tables,
                                               BLOCK_SIZE, CPU)
    return caches, torch.tensor([p[-1] for p in prompts]), positions, meta


def _decode(model, fused: bool, caches, input_ids, positions, meta):
    caches = [c.clone() for c in caches]
    model.use_fused_decode = fused
    try:
        with torch.inference_mode():
            hidden = model(input_ids, positions, caches, meta)
    finally:
        model.use_fused_decode = True
    return hidden, caches


@pytest.mark.parametrize("seq_lens", [[1], [9], [4, 17], [30, 2, 13], [5, 8, 21, 12],
                                      [3, 6, 9, 12, 15], [2, 4, 6, 8, 10, 12, 14, 16, 18]])
def test_fused_decode_matches_the_layer_path(model, seq_lens: list[int], fused_calls) -> None:
    """Hidden states and every layer's new K/V as the layer-by-layer path computes them,
    for 1 to 5 requests and 9: the fused call takes any step on packed weights (the any-M
    GEMM; every storage here packs)."""
    case = _prefilled(model, seq_lens)
    ours, ours_caches = _decode(model, True, *case)
    expected_calls = [len(seq_lens)] if len(seq_lens) <= model.fused_decode.max_tokens() else []
    assert fused_calls == expected_calls  # the prefill above took the layer path
    ref, ref_caches = _decode(model, False, *case)
    assert fused_calls == expected_calls
    tol = model.test_tolerance
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    for a, b in zip(ours_caches, ref_caches):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("seq_lens", [[9], [30, 2, 13]])
def test_fused_decode_reads_and_writes_a_bf16_kv_cache(model, seq_lens: list[int],
                                                       fused_calls) -> None:
    """With a bf16 KV cache the fused call writes K/V rounded as torch rounds them and
    attends over them widened, as the layer path's C attention does: the same hidden
    states and caches up to one bf16 step where a K/V element sits on a rounding edge."""
    case = _prefilled(model, seq_lens, kv_dtype=torch.bfloat16)
    ours, ours_caches = _decode(model, True, *case)
    assert fused_calls == [len(seq_lens)]
    ref, ref_caches = _decode(model, False, *case)
    tol = max(model.test_tolerance, 2e-2)
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    for a, b in zip(ours_caches, ref_caches):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_fused_decode_rejects_a_slot_outside_the_cache(model) -> None:
    caches, input_ids, positions, meta = _prefilled(model, [6, 3])
    before = [c.clone() for c in caches]
    meta.slot_mapping[1] = caches[0].shape[1] * BLOCK_SIZE  # one past the last slot
    with pytest.raises(IndexError, match="outside the cache"):
        with torch.inference_mode():
            model(input_ids, positions, caches, meta)
    for a, b in zip(caches, before):
        assert torch.equal(a, b)  # nothing written, in any layer


def test_fused_decode_runs_only_where_it_applies(model, set_cpu_kernels, fused_calls) -> None:
    """With another attention backend, or the kernels off, a decode step takes the layer
    path, with the fused path's results."""
    case = _prefilled(model, [7, 10])
    fused, _ = _decode(model, True, *case)
    assert fused_calls == [2]
    backend = model.attn_backend
    model.attn_backend = TorchAttentionBackend(use_cpu_kernel=False)  # SDPA decode
    try:
        torch_attention, _ = _decode(model, True, *case)
    finally:
        model.attn_backend = backend
    set_cpu_kernels("0")
    kernels_off, _ = _decode(model, True, *case)
    assert fused_calls == [2]
    tol = model.test_tolerance
    torch.testing.assert_close(torch_attention, fused, atol=tol, rtol=tol)
    torch.testing.assert_close(kernels_off, fused, atol=tol, rtol=tol)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_fused_decode_declines_weights_left_unpacked(tiny_model_dirs, fused_calls,
                                                     storage: str) -> None:
    """The fused call reads packed weights only (Linear.pack packs every weight the kernels
    read; the row-major gemvs are retired): with the weights unpacked it declines
    (kernel_format None, max_tokens 0) and the step takes the layer path (`linear`'s torch
    path), with the packed step's values."""
    dtype, quantization, tol = STORAGES[storage]
    loaded = load_model(str(tiny_model_dirs["qwen2"]), dtype, CPU, quantization).model
    case = _prefilled(loaded, [7, 10])
    packed, _ = _decode(loaded, True, *case)
    assert fused_calls == [2]
    for lin in (p for layer in loaded.layers for p in layer.projections()):
        lin.weight = torch.nn.Parameter(lin.dense_weight(), requires_grad=False)
        assert not lin.is_packed and lin.storage == storage and lin.kernel_format is None
    loaded.fused_decode.reset()  # raw pointers to the old weights
    assert loaded.fused_decode.max_tokens() == 0
    unpacked, _ = _decode(loaded, True, *case)
    assert fused_calls == [2] and loaded.last_executor == "layerwise"  # declined
    torch.testing.assert_close(unpacked, packed, atol=tol, rtol=tol)


def test_llama_decode_computes_nothing_for_a_row_major_format() -> None:
    """The kernel's own check (fail closed behind the Python one): codes 0-4, the retired
    row-major formats, return -2 before anything is read or written."""
    from aioengine.kernels.cpu_layout import DecodeStep

    lib = cpu_kernels.load()
    for code in range(5):
        assert lib.llama_decode(DecodeStep(weight_fmt=code)) == -2


def test_decode_layer_table_declines_what_the_kernel_cannot_read() -> None:
    w = torch.ones(4, 4)
    packed = cpu_gemm.pack_weight(w)  # [1, 4, 16]: one panel
    row = {name: None if name.endswith("_scales") else packed if name in PROJECTIONS else w
           for name in cpu_decode.DECODE_LAYER_FIELDS}
    table = cpu_decode.decode_layer_table([row, {**row, "qkv_bias": None, "q_norm": None,
                                                  "k_norm": None}])
    assert table is not None and table.num_layers == 2
    assert [table.layers[1].qkv_bias, table.layers[1].q_norm, table.layers[1].k_norm] == [None] * 3
    assert table.layers[0].input_norm == w.data_ptr() and table.layers[0].qkv_scales is None
    assert table.step.layers == ctypes.addressof(table.layers) and table.step.num_layers == 2
    q, s = cpu_gemm.pack_weight(torch.ones(4, 4, dtype=torch.int8)), torch.ones(4)
    int8_row = {**row, **{p: q for p in PROJECTIONS}, **{f"{p}_scales": s for p in PROJECTIONS}}
    assert cpu_decode.decode_layer_table([int8_row]) is not None
    assert cpu_decode.decode_layer_table([{**int8_row, "o_scales": None}]) is None  # int8 needs them
    # Scales the kernel would read past or misread: more rows than the panels hold, a 2-D
    # tensor, another dtype.
    for bad in (torch.ones(17), torch.ones(1, 4), torch.ones(4, dtype=torch.float64)):
        assert cpu_decode.decode_layer_table([{**int8_row, "down_scales": bad}]) is None
    mixed = {**row, "qkv": packed.bfloat16()}
    assert cpu_decode.decode_layer_table([mixed]) is None  # mixed formats
    assert cpu_decode.decode_layer_table([{**row, "qkv_scales": s}]) is None  # scales on float
    assert cpu_decode.decode_layer_table([{**row, "o": None}]) is None  # required
    assert cpu_decode.decode_layer_table([{**row, "down": packed.transpose(1, 2)}]) is None
    assert cpu_decode.decode_layer_table([{**row, "qkv": packed.double()}]) is None
    # Row-major weights, in any storage: no kernel reads them (the gemvs are retired).
    for dense, scales in ((w, None), (w.bfloat16(), None), (w.to(torch.int8), s)):
        row_major = {**row, **{p: dense for p in PROJECTIONS},
                     **{f"{p}_scales": scales for p in PROJECTIONS}}
        assert cpu_decode.decode_layer_table([row_major]) is None
    # A key the layer struct lacks, or one missing: the caller's mistake, not a decline.
    with pytest.raises(ValueError, match="unknown keys"):
        cpu_decode.decode_layer_table([{**row, "gate": w}])
    missing = dict(row)
    del missing["k_norm"]
    with pytest.raises(ValueError, match="missing keys .'k_norm'"):
        cpu_decode.decode_layer_table([missing])
