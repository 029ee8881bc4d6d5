"""The Python mirror of kernels/cpu/decode_layer.h: the structs the fused decode kernel
(`llama_decode`) takes, as ctypes.Structure classes, defined here once. Every pointer is a
c_void_p (filled from `Tensor.data_ptr()`: an int store, the cheapest ctypes field).

kernels/cpu/layout.c exports the C side's size of each struct and the name, offset and
size of each field (`c_layout`); tests/model/test_c_layout.py fails where they and these
classes disagree. Change a struct there: change it here, in the same order.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


# decode_layer.h's PROJ_MAX_PARTS (the test checks it against the library's).
PROJ_MAX_PARTS = 3


class ProjPart(ctypes.Structure):
    """proj_part: `rows` output rows of a weight packed in format `fmt` at `data`."""

    _fields_ = [("data", _ptr), ("scales", _ptr), ("rows", _i64), ("fmt", _i32)]


class ProjWeight(ctypes.Structure):
    """proj_weight: a projection weight of 1..PROJ_MAX_PARTS parts in output-row order."""

    _fields_ = [("parts", ProjPart * PROJ_MAX_PARTS), ("num_parts", _i64)]


class DecodeLayer(ctypes.Structure):
    """decode_layer: one layer's weights and KV cache."""

    _fields_ = [("input_norm", _ptr), ("qkv", ProjWeight), ("qkv_bias", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("o", ProjWeight), ("post_norm", _ptr),
                ("gate_up", ProjWeight), ("down", ProjWeight), ("kv_cache", _ptr)]


class LoRAProj(ctypes.Structure):
    """lora_proj: one projection's adapter slots."""

    _fields_ = [("a", _ptr), ("bt", _ptr), ("ranks", _ptr)]


class LoRALayer(ctypes.Structure):
    """lora_layer: a layer's adapter slots (LoRAManager keeps them as int64 rows of
    LORA_TABLE_WIDTH pointers in this order)."""

    _fields_ = [("qkv", LoRAProj), ("o", LoRAProj), ("gate_up", LoRAProj), ("down", LoRAProj)]


# decode_layer.h's LORA_LAYER_POINTERS (the test checks it against the library's).
LORA_TABLE_WIDTH = ctypes.sizeof(LoRALayer) // ctypes.sizeof(_ptr)


class DecodeStep(ctypes.Structure):
    """decode_step: the model's fields, then the step's; decode_layer.h says what each
    holds. One per layer table (`cpu.DecodeLayerTable.step`), refilled by each call."""

    _fields_ = [
        # the model
        ("layers", _ptr), ("num_layers", _i64), ("final_norm", _ptr), ("hidden", _i64),
        ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("cos_table", _ptr),
        ("sin_table", _ptr), ("num_threads", _i32), ("kv_bf16", _i32),
        # the step
        ("x", _ptr), ("num_tokens", _i64), ("positions", _ptr), ("slot_mapping", _ptr),
        ("block_tables", _ptr), ("table_stride", _i64), ("seq_lens", _ptr),
        ("num_blocks", _i64), ("block_size", _i64),
        ("aux", _ptr), ("aux_layers", _ptr), ("num_aux", _i64),
        ("lora", _ptr), ("token_slots", _ptr), ("lora_rank", _i64), ("lora_bf16", _i32),
        ("eagle_hidden", _ptr), ("eagle_hidden_norm", _ptr),
        ("eagle_norm_before_residual", _i32),
        ("tree_src", _ptr), ("tree_dst", _ptr), ("num_tree_copies", _i64)]


# The mirrored structs by their C names (layout.c's table).
C_STRUCTS: dict[str, type[ctypes.Structure]] = {
    "proj_part": ProjPart, "proj_weight": ProjWeight, "decode_layer": DecodeLayer, "lora_proj": LoRAProj, "lora_layer": LoRALayer,
    "decode_step": DecodeStep}


@dataclass(frozen=True)
class FieldLayout:
    """One field of a struct: its name, byte offset and size."""

    name: str
    offset: int
    size: int


class _CField(ctypes.Structure):
    """layout.c's layout_field."""

    _fields_ = [("name", ctypes.c_char_p), ("offset", _i64), ("size", _i64)]


def declare(lib: ctypes.CDLL) -> None:
    """The argument types of layout.c's, llama_decode.c's and projection.c's
    packed_gemm_parts entry points on `lib`."""
    declare_layout(lib)
    lib.llama_decode.argtypes = [ctypes.POINTER(DecodeStep)]
    lib.llama_decode.restype = _i64
    # (y, x, weight, bias, m, n, k, num_threads)
    lib.packed_gemm_parts.argtypes = [_ptr, _ptr, ctypes.POINTER(ProjWeight), _ptr, _i64, _i64,
                                      _i64, ctypes.c_int]
    lib.packed_gemm_parts.restype = ctypes.c_int


def declare_layout(lib: ctypes.CDLL) -> None:
    """The argument types of layout.c's entry points on `lib`."""
    fn = lib.c_struct_layout
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(_CField)),
                   ctypes.POINTER(_i64)]
    fn.restype = _i64
    lib.lora_layer_pointers.argtypes = []
    lib.lora_layer_pointers.restype = _i64
    lib.proj_max_parts.argtypes = []
    lib.proj_max_parts.restype = _i64


def c_layout(lib: ctypes.CDLL, name: str) -> tuple[int, list[FieldLayout]]:
    """(sizeof, fields in declaration order) of C struct `name` as the library was built.
    Raises KeyError for a struct layout.c does not describe."""
    fields, size = ctypes.POINTER(_CField)(), _i64()
    n = lib.c_struct_layout(name.encode(), ctypes.byref(fields), ctypes.byref(size))
    if n < 0:
        raise KeyError(f"layout.c describes no struct {name!r}")
    return size.value, [FieldLayout(fields[i].name.decode(), fields[i].offset, fields[i].size)
                        for i in range(n)]


def py_layout(struct: type[ctypes.Structure]) -> tuple[int, list[FieldLayout]]:
    """The same for a mirror class."""
    return ctypes.sizeof(struct), [
        FieldLayout(name, getattr(struct, name).offset, getattr(struct, name).size)
        for name, *_ in struct._fields_]


def layout_mismatches(lib: ctypes.CDLL) -> list[str]:
    """Where the mirror classes and the library's structs differ (empty: they agree), one
    line per struct: a wrong mirror would hand the kernel pointers in the wrong fields."""
    problems = []
    for name, struct in C_STRUCTS.items():
        try:
            c = c_layout(lib, name)
        except KeyError as e:
            problems.append(str(e))
            continue
        py = py_layout(struct)
        if c != py:
            problems.append(f"{name}: C (size {c[0]}) {c[1]} != Python {struct.__name__} "
                            f"(size {py[0]}) {py[1]}")
    if LORA_TABLE_WIDTH != lib.lora_layer_pointers():
        problems.append(f"LORA_LAYER_POINTERS {lib.lora_layer_pointers()} != "
                        f"LORA_TABLE_WIDTH {LORA_TABLE_WIDTH}")
    if PROJ_MAX_PARTS != lib.proj_max_parts():
        problems.append(f"PROJ_MAX_PARTS {lib.proj_max_parts()} != {PROJ_MAX_PARTS}")
    return problems
