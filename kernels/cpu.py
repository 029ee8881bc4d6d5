"""CPU kernels written in C, compiled on first use with the machine's C compiler.

Only what torch has no fast path for lives here, each file in `kernels/cpu/` explaining its
kernel: paged decode attention, which would otherwise gather every request's K/V blocks into
a padded copy on each layer; and, in place of several small allocating torch ops per layer,
rotary embedding in place, the K/V cache write (reshape_and_cache), RMSNorm with the residual
add fused in, and SiLU-and-mul. For decode steps of a few requests: a gemv that streams the
weights (float32, bf16 or int8 with per-row scales) faster than MKL's here, and all decoder
layers in one call (`llama_decode`), which removes the per-layer Python work that otherwise
costs a fifth of the step.

One source, several builds: the library is compiled once per instruction set (ISA_VARIANTS:
AVX2, AVX-512, AVX-512 with BF16 and VNNI) as each is first needed, into a cache directory
keyed by the source, the flags and the compiler, and the best one this CPU runs is loaded
at run time (AIOENGINE_CPU_ISA forces one; `use_variant` switches in tests). It is called
through ctypes (which releases the GIL). When no compiler is found or the build fails, each
function returns False and the caller keeps its torch path; AIOENGINE_CPU_KERNELS=0 turns
the kernels off (read on first use; `reset()` reads it again).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading

import torch
from torch import Tensor

from aioengine import cpu_info, envs

logger = logging.getLogger(__name__)

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
_SOURCES = [os.path.join(_DIR, name) for name in ("paged_decode_attention.c",
                                                  "rotary_embedding.c", "cache.c",
                                                  "layernorm.c", "activation.c", "gemv.c",
                                                  "llama_decode.c")]
_HEADERS = [os.path.join(_DIR, name) for name in ("parallel.h", "vec_math.h", "activation.h",
                                                  "attention.h", "gemv.h", "layernorm.h",
                                                  "rotary_embedding.h")]
# No -ffast-math: the softmax relies on IEEE exp/max; -O3 still vectorises the dot products
# once reassociation is allowed for them (-fassociative-math needs -fno-signed-zeros and
# -fno-trapping-math). -std=c11 alone would turn off FMA contraction, which halves the speed
# of polynomial code (activation.c).
_CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
           "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast",
           "-std=c11"]

# Instruction-set builds, best first: (name, -m flags, /proc/cpuinfo flags it needs).
# x86-64-v3 is AVX2 + FMA + F16C + BMI; x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL.
_V3_FLAGS = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
_V4_FLAGS = _V3_FLAGS + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
ISA_VARIANTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
     _V4_FLAGS + ("avx512_bf16", "avx512_vnni")),
    ("avx512", ("-march=x86-64-v4",), _V4_FLAGS),
    ("avx2", ("-march=x86-64-v3",), _V3_FLAGS),
)
# Anything else (an older x86, another architecture): the compiler's default target.
BASELINE_VARIANT = "baseline"

# GEMV_* of gemv.h: the storage formats of a projection's weight (int8 weight-only; with
# act_quant, GEMV_I8A8: W8A8).
WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
GEMV_I8A8 = 3


def weight_format(weight: Tensor, act_quant: bool = False) -> int:
    """The GEMV_* code of a weight: by dtype, W8A8 for int8 with quantized activations."""
    return GEMV_I8A8 if act_quant else WEIGHT_FORMATS[weight.dtype]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_variant: str | None = None  # the loaded (or chosen) build; None until load()
# AIOENGINE_CPU_KERNELS, read once: the model calls these kernels ~150 times per decode
# step, and reading the environment each time cost ~0.5 ms of a ~20 ms step.
_enabled: bool | None = None


def supported_variants() -> list[str]:
    """The builds this CPU can run, best first (BASELINE_VARIANT always last)."""
    flags = cpu_info.cpu_flags()
    names = [name for name, _, needs in ISA_VARIANTS if all(f in flags for f in needs)]
    return names + [BASELINE_VARIANT]


def _variant_flags(name: str) -> tuple[str, ...]:
    for variant, mflags, _ in ISA_VARIANTS:
        if variant == name:
            return mflags
    if name == BASELINE_VARIANT:
        return ()
    raise ValueError(f"unknown CPU kernel variant {name!r}; known: "
                     f"{[v for v, _, _ in ISA_VARIANTS] + [BASELINE_VARIANT]}")


def _choose_variant() -> str:
    forced = envs.AIOENGINE_CPU_ISA
    supported = supported_variants()
    if forced is None:
        return supported[0]
    _variant_flags(forced)  # a known name
    if forced not in supported:
        raise RuntimeError(f"AIOENGINE_CPU_ISA={forced}: this CPU runs only {supported}")
    return forced


def variant() -> str | None:
    """The build in use (after the first kernel call or `load()`), None when none loaded."""
    return _variant if _lib is not None else None


def _compiler() -> str | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0]) or shutil.which("gcc") or shutil.which("cc")


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "aioengine", "kernels")


def _build(name: str) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    source = b""
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            source += f.read()
    flags = [*_CFLAGS, *_variant_flags(name)]
    key = hashlib.sha256(source + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"cpu_kernels-{name}-{key}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Build beside the target and rename: concurrent builders never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, *_SOURCES, "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:2000]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_decode_attention_f32
    fn.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.rotary_embedding_f32
    fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = None
    fn = lib.reshape_and_cache_f32
    fn.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, i64, i64, ctypes.c_int]
    fn.restype = i64
    fn = lib.rms_norm_f32
    fn.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    fn = lib.fused_add_rms_norm_f32
    fn.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    fn = lib.silu_and_mul_f32
    fn.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    fn.restype = None
    fn = lib.gemv
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.llama_decode
    fn.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   ctypes.c_float, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, ctypes.c_int,
                   ctypes.c_int]
    fn.restype = i64
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on the first call; None when they cannot be used here."""
    global _lib, _load_error, _enabled, _variant
    if _enabled is None:
        _enabled = envs.AIOENGINE_CPU_KERNELS
    if not _enabled:
        return None
    if _lib is not None or _load_error is not None:
        return _lib
    with _lock:
        if _lib is None and _load_error is None:
            try:
                _variant = _variant or _choose_variant()
                _lib = _build(_variant)
                logger.debug("CPU kernels: the %s build", _variant)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _load_error = str(e)
                logger.warning("CPU kernels unavailable, using the torch path: %s", e)
    return _lib


def use_variant(name: str | None) -> None:
    """Loads the `name` build from now on (None: the best this CPU runs, or
    AIOENGINE_CPU_ISA). Raises RuntimeError when this CPU cannot run it. For tests and
    benchmarks: callers holding results of the old build are unaffected."""
    global _lib, _load_error, _variant
    with _lock:
        if name is not None:
            _variant_flags(name)
            if name not in supported_variants():
                raise RuntimeError(f"this CPU cannot run the {name} build: it runs "
                                   f"{supported_variants()}")
        _lib, _load_error, _variant = None, None, name


def reset() -> None:
    """Forgets the AIOENGINE_CPU_KERNELS setting read so far (for tests that change it);
    the next call reads it again. A library already built stays loaded."""
    global _enabled
    _enabled = None


def _f32_rows(*tensors: Tensor) -> bool:
    """Every tensor float32 on the CPU and contiguous."""
    for t in tensors:  # a plain loop: a generator here cost ~1 us per call
        if not (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()):
            return False
    return True


def paged_decode_attention(out: Tensor, q: Tensor, kv_cache: Tensor, block_tables: Tensor,
                           seq_lens: Tensor, scale: float) -> bool:
    """out[n] = softmax(q[n] K_n^T * scale) V_n over request n's first seq_lens[n] positions.

    out/q [N, Hq, D] float32, kv_cache [2, blocks, block_size, Hkv, D] float32, block_tables
    [N, >= blocks needed] int32, seq_lens [N] int32 (each >= 1), all contiguous on the CPU.
    Returns False, leaving `out` untouched, when the kernel does not apply or is not built.
    """
    if not (_f32_rows(out, q, kv_cache) and block_tables.dtype == seq_lens.dtype == torch.int32
            and block_tables.is_contiguous() and seq_lens.is_contiguous()):
        return False
    lib = load()
    if lib is None:
        return False
    num_reqs, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    rc = lib.paged_decode_attention_f32(
        out.data_ptr(), q.data_ptr(), kv_cache.data_ptr(), num_blocks,
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), num_reqs,
        num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode_attention: out of memory for the score buffer")
    return True


def rotary_embedding(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Rotates x [T, H, D] in place (neox style: pairs (i, i + D/2)) by the angles of
    `positions` [T] (int64), reading cos/sin tables [max_positions, D/2].

    x float32 on the CPU with contiguous heads (any token stride: q and k heads inside a
    fused qkv output qualify); tables float32 and contiguous. Positions must be in range
    (the caller's invariant: they come from the scheduler). Returns False, leaving x
    untouched, when the kernel does not apply or is not built.
    """
    num_tokens, num_heads, head_dim = x.shape
    if not (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and x.stride(2) == 1 and x.stride(1) == head_dim
            and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape[-1] * 2 == head_dim and positions.shape == (num_tokens,)):
        return False
    lib = load()
    if lib is None:
        return False
    lib.rotary_embedding_f32(x.data_ptr(), num_tokens, x.stride(0), num_heads, head_dim,
                             positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             torch.get_num_threads())
    return True


def reshape_and_cache(key: Tensor, value: Tensor, kv_cache: Tensor,
                      slot_mapping: Tensor) -> bool:
    """Writes key/value [T, Hkv, D] into kv_cache [2, blocks, block_size, Hkv, D] at the
    slots of slot_mapping [T] (int64): kv_cache[0].view(-1, Hkv, D)[slot_mapping[t]] =
    key[t], and the same for value in kv_cache[1].

    key/value float32 on the CPU with contiguous heads (any token stride: views into a fused
    qkv output qualify). Raises IndexError, writing nothing, for a slot outside the cache.
    Returns False, writing nothing, when the kernel does not apply or is not built.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    if not (_f32_rows(kv_cache) and value.shape == key.shape
            and key.dtype == value.dtype == torch.float32 and key.device.type == "cpu"
            and value.device.type == "cpu" and kv_cache.shape[-2:] == key.shape[1:]
            and key.stride(2) == value.stride(2) == 1
            and key.stride(1) == value.stride(1) == head_dim
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.shape == (num_tokens,)):
        return False
    lib = load()
    if lib is None:
        return False
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    bad = lib.reshape_and_cache_f32(
        key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), kv_cache.data_ptr(),
        num_slots, slot_mapping.data_ptr(), num_tokens, row, torch.get_num_threads())
    if bad:
        raise IndexError(f"reshape_and_cache: {bad} slot(s) outside the cache's "
                         f"{num_slots} slots")
    return True


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """x [T, H] / sqrt(mean(x^2) + eps) * weight [H], as a new tensor; None when the kernel
    does not apply (float32 contiguous CPU tensors) or is not built."""
    if not (x.dim() == 2 and weight.shape == x.shape[1:] and _f32_rows(x, weight)):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty_like(x)
    lib.rms_norm_f32(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
                     eps, torch.get_num_threads())
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> bool:
    """In place: residual += x, then x = rms_norm(residual) * weight. x and residual [T, H],
    distinct. Returns False, changing nothing, when the kernel does not apply (float32
    contiguous CPU tensors) or is not built."""
    if not (x.dim() == 2 and residual.shape == x.shape and weight.shape == x.shape[1:]
            and _f32_rows(x, residual, weight)):
        return False
    lib = load()
    if lib is None:
        return False
    lib.fused_add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                               x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return True


def silu_and_mul(x: Tensor) -> Tensor | None:
    """x [T, 2d] = [gate | up] -> silu(gate) * up [T, d], as a new tensor; None when the
    kernel does not apply (float32 contiguous CPU tensor) or is not built."""
    if not (x.dim() == 2 and x.shape[1] % 2 == 0 and _f32_rows(x)):
        return None
    lib = load()
    if lib is None:
        return None
    d = x.shape[1] // 2
    out = x.new_empty((x.shape[0], d))
    lib.silu_and_mul_f32(out.data_ptr(), x.data_ptr(), x.shape[0], d, torch.get_num_threads())
    return out


def _weight_ok(weight: Tensor, scales: Tensor | None) -> bool:
    """A projection weight [N, K] the gemv reads: float32 or bf16, or int8 with float32
    scales [N]; contiguous on the CPU."""
    if not (weight.dim() == 2 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dtype in WEIGHT_FORMATS):
        return False
    if weight.dtype == torch.int8:
        return scales is not None and scales.shape == weight.shape[:1] and _f32_rows(scales)
    return scales is None


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
         scales: Tensor | None = None, act_quant: bool = False) -> Tensor | None:
    """x [M, K] @ weight [N, K]^T (* scales [N]) (+ bias [N]) -> [M, N] float32, for a few
    rows of x (decode; any M works, 4 rows at a time). x float32; weight float32, bf16
    (x and the result rounded to bf16, as oneDNN's bf16 matmul computes) or int8 with
    per-row scales: weight-only (x stays float32) or, with act_quant, W8A8 (x quantized
    per row, exact integer sums: layers._w8a8_linear's bits). None when the kernel does
    not apply or is not built."""
    if not (x.dim() == 2 and x.shape[1] == weight.shape[-1] and _f32_rows(x)
            and _weight_ok(weight, scales) and (not act_quant or weight.dtype == torch.int8)
            and (bias is None or (bias.shape == weight.shape[:1] and _f32_rows(bias)))):
        return None
    lib = load()
    if lib is None:
        return None
    m, (n, k) = x.shape[0], weight.shape
    out = x.new_empty((m, n))
    rc = lib.gemv(out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                  0 if scales is None else scales.data_ptr(), weight_format(weight, act_quant),
                  0 if bias is None else bias.data_ptr(), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("gemv: out of memory for its input buffer")
    return out


# The pointers of one decoder layer, in the order of llama_decode.c's `decode_layer`.
DECODE_LAYER_FIELDS = ("input_norm", "qkv", "qkv_scales", "qkv_bias", "q_norm", "k_norm", "o",
                       "o_scales", "post_norm", "gate_up", "gate_up_scales", "down",
                       "down_scales", "kv_cache")
_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The ones a model may lack (null pointers for the kernel).
_OPTIONAL_DECODE_FIELDS = frozenset({"qkv_bias", "q_norm", "k_norm", "qkv_scales", "o_scales",
                                     "gate_up_scales", "down_scales"})


def decode_layer_table(layers: list[dict[str, Tensor | None]]) -> Tensor | None:
    """The [num_layers, 14] int64 table of data pointers llama_decode takes, one row per
    layer from a dict keyed by DECODE_LAYER_FIELDS (biases, q/k norms and, but for int8
    projections, the scales may be None). None when a tensor does not fit: every projection
    of the model in one format of WEIGHT_FORMATS (int8 with its scales), everything else
    float32; all contiguous on the CPU. The table holds raw pointers: keep the tensors
    alive, and rebuild it if any is replaced."""
    formats = set()
    rows = []
    for layer in layers:
        row = []
        for name in DECODE_LAYER_FIELDS:
            t = layer[name]
            if name in _PROJECTIONS:
                ok = t is not None and _weight_ok(t, layer[f"{name}_scales"])
                formats.add(None if t is None else t.dtype)
            else:
                ok = t is None and name in _OPTIONAL_DECODE_FIELDS or t is not None and _f32_rows(t)
            if not ok:
                return None
            row.append(0 if t is None else t.data_ptr())
        rows.append(row)
    if len(formats) > 1:
        return None
    return torch.tensor(rows, dtype=torch.int64)


def llama_decode(x: Tensor, layer_table: Tensor, final_norm: Tensor, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate_size: int, eps: float,
                 scale: float, positions: Tensor, cos: Tensor, sin: Tensor,
                 slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 num_blocks: int, block_size: int, weight_format: int = 0) -> bool:
    """Runs every decoder layer and the final norm for a decode step, one token per request,
    in place: x [T, H] goes in as the embeddings and comes out as the final-normed hidden
    states; each layer's K/V are written into its cache (kernels/cpu/llama_decode.c).

    layer_table from `decode_layer_table`; positions and slot_mapping [T] int64;
    block_tables [T, max_blocks] and seq_lens [T] int32 (AttentionMetadata's); cos/sin
    [max_positions, head_dim / 2]; weight_format the projections' WEIGHT_FORMATS value.
    Raises IndexError, writing nothing, for a slot outside the caches. Returns False, changing nothing, when the kernel does not apply or is not
    built.
    """
    t = x.shape[0]
    if not (x.dim() == 2 and _f32_rows(x, final_norm, cos, sin)
            and layer_table.dtype == torch.int64 and layer_table.is_contiguous()
            and layer_table.shape[1:] == (len(DECODE_LAYER_FIELDS),)
            and positions.dtype == slot_mapping.dtype == torch.int64
            and positions.shape == slot_mapping.shape == (t,)
            and positions.is_contiguous() and slot_mapping.is_contiguous()
            and block_tables.dtype == seq_lens.dtype == torch.int32
            and block_tables.dim() == 2 and block_tables.shape[0] == t
            and block_tables.is_contiguous() and seq_lens.shape == (t,)
            and seq_lens.is_contiguous() and cos.shape[-1] * 2 == head_dim):
        return False
    lib = load()
    if lib is None:
        return False
    rc = lib.llama_decode(
        x.data_ptr(), layer_table.data_ptr(), layer_table.shape[0], final_norm.data_ptr(), t,
        x.shape[1], num_heads, num_kv_heads, head_dim, intermediate_size, eps, scale,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), num_blocks,
        block_size, weight_format, torch.get_num_threads())
    if rc > 0:
        raise IndexError(f"llama_decode: {rc} slot(s) outside the cache's "
                         f"{num_blocks * block_size} slots")
    if rc < 0:
        raise MemoryError("llama_decode: out of memory for its buffers")
    return True
