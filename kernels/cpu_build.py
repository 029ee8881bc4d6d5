"""Building and loading the CPU kernels of `aioengine.kernels.cpu`: one shared library per
instruction set (ISA_VARIANTS), compiled on first use with the machine's C compiler into a
cache directory keyed by the source, the flags and the compiler; the best build this CPU's
flags allow is loaded at run time (AIOENGINE_CPU_ISA forces one; `use_variant` switches in
tests). AIOENGINE_CPU_KERNELS=0 turns the kernels off (read on first use; `reset()` reads
it again).
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading

from aioengine import cpu_info, envs
from aioengine.kernels import cpu_layout

logger = logging.getLogger("aioengine.kernels.cpu")

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")


def _sources(source_dir: str) -> list[str]:
    """The C sources the library is built from: every .c file of the directory."""
    return sorted(glob.glob(os.path.join(source_dir, "*.c")))


def _inputs(source_dir: str) -> list[str]:
    """Every file the build reads: the sources and every header they may include (all of
    the directory's, so a header no list names cannot leave a stale build in the cache)."""
    return sorted(glob.glob(os.path.join(source_dir, "*.[ch]")))


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
    # AVX512-BF16 plus AMX tiles for the bf16 GEMM (gemm_amx.c; used where the kernel grants
    # the tile state, set_amx_mode).
    ("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16",
             "-mamx-int8"),
     _V4_FLAGS + ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")),
    ("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
     _V4_FLAGS + ("avx512_bf16", "avx512_vnni")),
    ("avx512", ("-march=x86-64-v4",), _V4_FLAGS),
    ("avx2", ("-march=x86-64-v3",), _V3_FLAGS),
)
# Anything else (an older x86, another architecture): the compiler's default target.
BASELINE_VARIANT = "baseline"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_variant: str | None = None  # the loaded (or chosen) build; None until load()
_amx_mode = 0  # gemm.h's gemm_amx_mode as set in the loaded build (AMX_MODES)
AMX_MODES = {0: None, 1: "tiles", 2: "emulated"}
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
    return str(envs.kernel_cache_dir())


def cache_key(name: str, cc: str, source_dir: str = _DIR) -> str:
    """The build cache's key of variant `name`: every input file's name and bytes, the
    flags and the compiler."""
    h = hashlib.sha256()
    for path in _inputs(source_dir):
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    h.update(" ".join([cc, *_CFLAGS, *_variant_flags(name)]).encode())
    return h.hexdigest()[:16]


def _compile(cc: str, flags: list[str], out: str, timeout: float = 240.0) -> None:
    """Every source to an object file, all at once (the GEMM's tiles alone take ~20 s of
    one core), then one link into `out`. Raises RuntimeError with the compiler's message."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as objdir:
        objects, procs = [], []
        for src in _sources(_DIR):
            obj = os.path.join(objdir, os.path.basename(src) + ".o")
            objects.append(obj)
            procs.append(subprocess.Popen([cc, *flags, "-c", src, "-o", obj], text=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        errors = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                err = f"timed out after {timeout:.0f} s"
            if proc.returncode != 0:
                errors.append(err.strip())
        if errors:
            raise RuntimeError(f"{cc} failed: {' / '.join(errors)[:2000]}")
        link = subprocess.run([cc, *flags, *objects, "-o", out, "-lm"], capture_output=True,
                              text=True, timeout=timeout)
        if link.returncode != 0:
            raise RuntimeError(f"{cc} failed to link: {link.stderr.strip()[:2000]}")


def _built_file(name: str) -> str:
    """The path of the `name` build in the cache, compiled first when missing."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = [*_CFLAGS, *_variant_flags(name)]
    path = os.path.join(_cache_dir(), f"cpu_kernels-{name}-{cache_key(name, cc)}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Build beside the target and rename: concurrent builders never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            _compile(cc, flags, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def build_variants(names: list[str]) -> dict[str, str | None]:
    """Compiles the builds `names` that the cache lacks, two at a time (a build's time is
    mostly one large source on one core, so a second build fills the other core), without
    loading any. Returns name -> None, or the error that build raised. For tests and
    benchmarks that switch builds (use_variant)."""
    from concurrent.futures import ThreadPoolExecutor

    def build(name: str) -> str | None:
        try:
            _built_file(name)
            return None
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(build, names)))


def _build(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(_built_file(name))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.paged_attention_f32
    fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64,
                   i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.rotary_embedding_f32
    fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = None
    for fn in (lib.reshape_and_cache_f32, lib.reshape_and_cache_bf16):
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
    fn = lib.argmax_rows_f32
    fn.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    fn.restype = None
    fn = lib.packed_gemm
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    cpu_layout.declare(lib)  # llama_decode and the layout table
    mismatches = cpu_layout.layout_mismatches(lib)
    if mismatches:  # the kernel would read the wrong fields: the torch path instead
        raise RuntimeError(f"kernels/cpu_layout.py disagrees with decode_layer.h: {mismatches}")
    fn = lib.pack_gguf_blocks
    fn.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.gemm_set_amx_mode
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.lora_apply_f32
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                   i64, ctypes.c_int]
    fn.restype = ctypes.c_int
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
                _set_amx_mode(_lib, _wanted_amx_mode())
                logger.debug("CPU kernels: the %s build, bf16 GEMM on %s", _variant,
                             AMX_MODES[_amx_mode] or "vector registers")
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _load_error = str(e)
                logger.warning("CPU kernels unavailable, using the torch path: %s", e)
    return _lib


def _wanted_amx_mode() -> int:
    setting = envs.AIOENGINE_AMX
    modes = {"auto": 1 if _variant == "amx" else 0, "0": 0, "off": 0, "1": 1, "on": 1,
             "emulate": 2}
    if setting not in modes:
        raise RuntimeError(f"AIOENGINE_AMX={setting!r}: expected one of {sorted(modes)}")
    return modes[setting]


def _set_amx_mode(lib: ctypes.CDLL, mode: int) -> int:
    global _amx_mode
    _amx_mode = lib.gemm_set_amx_mode(mode)
    if mode == 1 and _amx_mode != 1:
        logger.warning("AMX tiles unavailable (the %s build, or the kernel refused the tile "
                       "state): the bf16 GEMM stays on vector registers", _variant)
    return _amx_mode


def amx_mode() -> str | None:
    """Where the loaded build's bf16 GEMM runs: "tiles" (AMX), "emulated" (AMX's arithmetic
    in software) or None (vector registers; also when no build is loaded)."""
    return AMX_MODES[_amx_mode] if _lib is not None else None


def set_amx_mode(mode: int) -> str | None:
    """Switches the loaded build's bf16 GEMM (0 vector registers, 1 AMX tiles, 2 emulated
    tiles; 1 falls back to 0 where unavailable) and returns amx_mode(). For tests and
    benchmarks: never while a product runs."""
    lib = load()
    if lib is None:
        return None
    with _lock:
        _set_amx_mode(lib, mode)
    return amx_mode()


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


def load_error() -> str | None:
    """Why the kernels could not be built or loaded, if they could not."""
    return _load_error
