"""The one-call decode of kernels/cpu/llama_decode.c against the layer-by-layer forward it
replaces for decode steps of a few requests (LlamaForCausalLM.use_fused_decode)."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch
from tiny_models import TINY_ARCHS

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_decode, cpu_gemm, cpu_layout
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


def _one_part(fmt: int, rows: int, data: int = 1) -> cpu_layout.ProjWeight:
    w = cpu_layout.ProjWeight(num_parts=1)
    w.parts[0].data, w.parts[0].rows, w.parts[0].fmt = data, rows, fmt
    return w


def test_llama_decode_computes_nothing_for_a_weight_it_does_not_read() -> None:
    """The kernel's own check (fail closed behind the Python one), before anything is read
    or written: codes 0-4 (the retired row-major formats), parts whose rows do not add up to
    the projection's width, parts reading x in different forms (float32 and a block
    format), more parts than PROJ_MAX_PARTS, a part before the last not whole panels."""
    lib = cpu_kernels.load()
    dims = dict(hidden=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate=32)
    qkv_n = 2 * 16 + 2 * 16

    def run(**proj: cpu_layout.ProjWeight) -> int:
        layer = cpu_layout.DecodeLayer(qkv=_one_part(12, qkv_n), o=_one_part(12, 32),
                                       gate_up=_one_part(12, 64), down=_one_part(12, 32))
        for name, w in proj.items():
            setattr(layer, name, w)
        step = cpu_layout.DecodeStep(layers=ctypes.addressof(layer), num_layers=1,
                                     num_threads=1, **dims)
        return lib.llama_decode(step)

    for code in range(5):
        assert run(o=_one_part(code, 32)) == -2
    assert run(down=_one_part(14, 31)) == -2  # rows != hidden
    mixed = _one_part(12, 32)
    mixed.num_parts, mixed.parts[1].data, mixed.parts[1].rows = 2, 1, 32
    mixed.parts[1].fmt = 5  # float32 x beside a block format's per-256 x
    assert run(qkv=mixed) == -2
    mixed.parts[1].fmt = 11  # Q4_0's per-32 x beside Q4_K's per-256 x
    assert run(qkv=mixed) == -2
    too_many = _one_part(12, 16)
    too_many.num_parts = 4
    assert run(qkv=too_many) == -2
    ragged = _one_part(12, 24)
    ragged.num_parts, ragged.parts[1].data, ragged.parts[1].rows = 2, 1, 40
    ragged.parts[1].fmt = 14
    assert run(qkv=ragged) == -2  # 24 rows then 40: a panel would straddle the parts


def _packed(weight: torch.Tensor, scales: torch.Tensor | None = None):
    return cpu_decode.packed_projection(weight, scales, 4)


def test_decode_layer_table_declines_what_the_kernel_cannot_read() -> None:
    w = torch.ones(4, 4)
    packed = cpu_gemm.pack_weight(w)  # [1, 4, 16]: one panel
    row = {name: _packed(packed) if name in PROJECTIONS else w
           for name in cpu_decode.DECODE_LAYER_FIELDS}
    table = cpu_decode.decode_layer_table([row, {**row, "qkv_bias": None, "q_norm": None,
                                                  "k_norm": None}])
    assert table is not None and table.num_layers == 2
    assert [table.layers[1].qkv_bias, table.layers[1].q_norm, table.layers[1].k_norm] == [None] * 3
    qkv = table.layers[0].qkv
    assert table.layers[0].input_norm == w.data_ptr() and qkv.parts[0].scales is None
    assert (qkv.num_parts, qkv.parts[0].data, qkv.parts[0].rows) == (1, packed.data_ptr(), 4)
    assert qkv.parts[0].fmt == cpu_gemm.PACKED_FORMATS[torch.float32]
    assert table.step.layers == ctypes.addressof(table.layers) and table.step.num_layers == 2
    q, s = cpu_gemm.pack_weight(torch.ones(4, 4, dtype=torch.int8)), torch.ones(4)
    int8_row = {**row, **{p: _packed(q, s) for p in PROJECTIONS}}
    assert cpu_decode.decode_layer_table([int8_row]) is not None
    assert _packed(q) is None  # int8 needs its scales
    # Scales the kernel would read past or misread: more rows than the panels hold, a 2-D
    # tensor, another dtype.
    for bad in (torch.ones(17), torch.ones(1, 4), torch.ones(4, dtype=torch.float64)):
        assert _packed(q, bad) is None
    # Each projection in its own format is fine now (a GGUF's Q4_K and Q6_K ones).
    assert cpu_decode.decode_layer_table([{**row, "qkv": _packed(packed.bfloat16())}]) is not None
    assert _packed(packed, s) is None  # scales on float
    assert cpu_decode.decode_layer_table([{**row, "o": None}]) is None  # required
    assert _packed(packed.transpose(1, 2)) is None
    assert _packed(packed.double()) is None
    # Row-major weights, in any storage: no kernel reads them (the gemvs are retired).
    for dense, scales in ((w, None), (w.bfloat16(), None), (w.to(torch.int8), s)):
        assert _packed(dense, scales) is None
    # Parts of a float format and a block format: one x form per weight.
    mixed = cpu_decode.DecodeProjection(
        (cpu_decode.DecodePart(packed.data_ptr(), 5, 16), cpu_decode.DecodePart(1, 12, 4)),
        (packed,))
    assert cpu_decode.decode_layer_table([{**row, "qkv": mixed}]) is None
    # A K-quant beside a 32-block format: x per 256 for one, per 32 for the other.
    mixed = cpu_decode.DecodeProjection(
        (cpu_decode.DecodePart(1, 12, 16), cpu_decode.DecodePart(1, 11, 4)), (packed,))
    assert cpu_decode.decode_layer_table([{**row, "qkv": mixed}]) is None
    # A key the layer struct lacks, or one missing: the caller's mistake, not a decline.
    with pytest.raises(ValueError, match="unknown keys"):
        cpu_decode.decode_layer_table([{**row, "gate": w}])
    missing = dict(row)
    del missing["k_norm"]
    with pytest.raises(ValueError, match="missing keys .'k_norm'"):
        cpu_decode.decode_layer_table([missing])


# ---- GGUF block weights: each projection in its own block format(s) -----------------------

# Per layer, each projection's parts (block type, rows) for hidden 256, 4 heads of 64, 2 KV
# heads, intermediate 256: a Q4_K_M file's shapes (Q4_K q/k with a Q6_K v, Q6_K down) and
# the other block formats, one to three parts a projection.
BLOCK_PROJECTIONS = (
    {"qkv_proj": (("q4_k", 384), ("q6_k", 128)), "o_proj": (("q4_k", 256),),
     "gate_up_proj": (("q8_0", 512),), "down_proj": (("q6_k", 256),)},
    {"qkv_proj": (("q4_k", 256), ("q5_k", 128), ("q6_k", 128)), "o_proj": (("q5_k", 256),),
     "gate_up_proj": (("q4_0", 256), ("q4_1", 256)), "down_proj": (("q4_k", 256),)},
)
_GGUF_QUANTIZED = {"q8_0", "q4_0", "q4_1"}  # gguf.quants.quantize writes these


def _random_blocks(rows: int, k: int, block_type: str, gen: torch.Generator) -> torch.Tensor:
    """A file's blocks uint8 [rows, row_bytes]: random floats quantized by gguf where it
    quantizes the type; else (the K-quants) random codes and scales with fp16 d (and dmin)
    small enough for weights of ~0.1."""
    from aioengine.kernels import cpu_blocks
    from gguf.quants import quantize

    f = cpu_blocks.BLOCK_TYPES[block_type]
    if block_type in _GGUF_QUANTIZED:
        w = torch.randn(rows, k, generator=gen) * 0.05
        return torch.from_numpy(quantize(w.numpy(), f.ggml_type).copy())
    b = torch.randint(0, 256, (rows, k // 256, f.block_bytes), generator=gen, dtype=torch.uint8)
    d = torch.full((rows, k // 256), 1e-4 if block_type != "q6_k" else 5e-5, dtype=torch.float16)
    d_bytes = d.view(torch.uint8).view(rows, k // 256, 2)
    if block_type == "q6_k":
        b[..., 208:210] = d_bytes
    else:
        b[..., 0:2] = b[..., 2:4] = d_bytes  # d, dmin
    return b.reshape(rows, -1)


def _use_blocks(model, seed: int = 0) -> None:
    """Every projection of the model replaced by random GGUF blocks in BLOCK_PROJECTIONS'
    types, installed as the loader installs them (Linear.use_block_storage and
    load_block_rows)."""
    from aioengine.kernels import cpu_blocks

    gen = torch.Generator().manual_seed(seed)
    for layer, spec in zip(model.layers, BLOCK_PROJECTIONS):
        for name, parts in spec.items():
            lin = getattr(layer, name)
            lin.use_block_storage(cpu_blocks.layout_for(parts, lin.in_features))
            first = 0
            for block_type, rows in parts:
                lin.load_block_rows(first, _random_blocks(rows, lin.in_features, block_type,
                                                          gen), block_type)
                first += rows
    model.fused_decode.reset()  # raw pointers to the old weights


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def block_model(request, tmp_path_factory, bundled_tokenizer):
    """A 2-layer tiny model whose projections are GGUF blocks of several types (qwen2: with
    a qkv bias, sliced over the parts)."""
    from tiny_models import make_tiny_model_dir

    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    path = make_tiny_model_dir(request.param, tmp_path_factory.mktemp("block_model"),
                               tokenizer=bundled_tokenizer, hidden_size=256,
                               intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2)
    loaded = load_model(str(path), torch.float32, CPU, None).model
    _use_blocks(loaded)
    return loaded


@pytest.mark.parametrize("seq_lens", [[1], [9], [30, 2, 13], [2, 4, 6, 8, 10, 12, 14, 16, 18]])
def test_fused_decode_runs_mixed_block_formats_as_the_layer_path(block_model, seq_lens,
                                                                 fused_calls) -> None:
    """Projections in different GGUF block formats, q/k/v and gate/up as weights of parts
    (a Q4_K_M file's Q6_K v among them): the fused call takes the step and gives the layer
    path's bits (the same GEMM per projection: x quantized per 32-block once, every part
    into its columns), hidden states and every layer's new K/V."""
    storages = {lin.storage for layer in block_model.layers for lin in layer.projections()}
    assert {"mixed:q4_k+q6_k", "mixed:q4_k+q5_k+q6_k", "mixed:q4_0+q4_1", "q6_k"} <= storages
    case = _prefilled(block_model, seq_lens)
    ours, ours_caches = _decode(block_model, True, *case)
    assert fused_calls == [len(seq_lens)] and block_model.last_executor == "fused_cpu_decode"
    ref, ref_caches = _decode(block_model, False, *case)
    assert block_model.last_executor == "layerwise"
    assert ours.abs().max() > 0 and torch.isfinite(ours).all()
    assert torch.equal(ours, ref)
    for a, b in zip(ours_caches, ref_caches):
        assert torch.equal(a, b)


def test_block_weight_parts_are_one_gemm_of_the_reference(block_model) -> None:
    """cpu_blocks.gemm on a weight of three parts (x prepared once, each part into its
    columns, bias sliced) is its reference (x quantized per 32-block, the weight
    dequantized) up to float32 summation order, and each part alone gives its columns'
    bits."""
    from aioengine.kernels import cpu_blocks

    lin = block_model.layers[1].qkv_proj
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(3))
    out = cpu_blocks.gemm(x, lin.weight, lin.blocks, lin.bias)
    ref = cpu_blocks.reference_linear(x, lin.weight, lin.blocks, lin.bias)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    col = 0
    for part in lin.blocks.parts:
        alone = cpu_blocks.layout_for([(part.block_type, part.rows)], lin.in_features)
        data = lin.weight[part.offset:part.offset + part.nbytes]
        bias = None if lin.bias is None else lin.bias[col:col + part.rows].contiguous()
        assert torch.equal(cpu_blocks.gemm(x, data, alone, bias), out[:, col:col + part.rows])
        col += part.rows
