"""The C contract of the fused decode kernel: kernels/cpu_layout.py's ctypes mirrors of
kernels/cpu/decode_layer.h's structs against the layouts the compiler gave them (layout.c's
table), and the build cache's key covering every file the library is built from."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_build, cpu_layout

CPU_DIR = Path(cpu_build.__file__).parent / "cpu"


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = cpu_kernels.load()
    assert lib is not None, cpu_kernels.load_error()
    return lib


@pytest.mark.parametrize("name", sorted(cpu_layout.C_STRUCTS))
def test_mirror_matches_the_c_struct(lib: ctypes.CDLL, name: str) -> None:
    c_size, c_fields = cpu_layout.c_layout(lib, name)
    py_size, py_fields = cpu_layout.py_layout(cpu_layout.C_STRUCTS[name])
    assert [f.name for f in py_fields] == [f.name for f in c_fields]  # names, order, count
    assert py_fields == c_fields  # every offset and size
    assert py_size == c_size
    assert cpu_layout.layout_mismatches(lib) == []


def test_lora_table_width_is_the_c_constant(lib: ctypes.CDLL) -> None:
    assert cpu_layout.LORA_TABLE_WIDTH == lib.lora_layer_pointers() == 12
    assert cpu_kernels.LORA_TABLE_WIDTH == cpu_layout.LORA_TABLE_WIDTH
    with pytest.raises(KeyError):
        cpu_layout.c_layout(lib, "no_such_struct")


def _layout_lib(src: Path, out: Path) -> ctypes.CDLL:
    """layout.c of `src` alone as a library (it includes only decode_layer.h)."""
    cc = cpu_build._compiler()
    assert cc is not None
    subprocess.run([cc, "-O1", "-fPIC", "-shared", "-std=c11", str(src / "layout.c"), "-o",
                    str(out)], check=True, capture_output=True, timeout=60)
    lib = ctypes.CDLL(str(out))
    cpu_layout.declare_layout(lib)
    return lib


@pytest.mark.parametrize("edit", [
    ("int32_t lora_bf16;", "int64_t lora_bf16;"),  # a field retyped
    ("    const float *cos_table, *sin_table;", "    const float *sin_table, *cos_table;"),
    ("    void *kv_cache;\n", "    void *kv_cache;\n    const float *extra;\n"),  # added
])
def test_a_header_the_mirror_does_not_follow_is_caught(tmp_path: Path,
                                                       edit: tuple[str, str]) -> None:
    """The check fails where decode_layer.h changes and cpu_layout.py does not (and passes
    for the header as it is, built the same way)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("layout.c", "decode_layer.h"):
        shutil.copy(CPU_DIR / name, src / name)
    assert cpu_layout.layout_mismatches(_layout_lib(src, tmp_path / "same.so")) == []
    header = (src / "decode_layer.h").read_text()
    assert edit[0] in header
    (src / "decode_layer.h").write_text(header.replace(edit[0], edit[1]))
    assert cpu_layout.layout_mismatches(_layout_lib(src, tmp_path / "edited.so")) != []


def test_build_key_covers_every_source_and_header(tmp_path: Path) -> None:
    src = tmp_path / "cpu"
    shutil.copytree(CPU_DIR, src)
    # Every C file of the directory is built (none left out of a list).
    assert {Path(p).name for p in cpu_build._sources(str(src))} == \
        {p.name for p in CPU_DIR.glob("*.c")}
    key = cpu_build.cache_key(cpu_build.BASELINE_VARIANT, "cc", str(src))
    lora_h = (src / "lora.h").read_text()
    (src / "lora.h").write_text(lora_h + "/* edited */\n")  # a header no .c file lists
    edited = cpu_build.cache_key(cpu_build.BASELINE_VARIANT, "cc", str(src))
    (src / "lora.h").write_text(lora_h)
    assert edited != key
    assert cpu_build.cache_key(cpu_build.BASELINE_VARIANT, "cc", str(src)) == key
    (src / "new.h").write_text("/* a new header */\n")
    assert cpu_build.cache_key(cpu_build.BASELINE_VARIANT, "cc", str(src)) != key
    (src / "new.h").unlink()
    assert cpu_build.cache_key("avx2", "cc", str(src)) != key  # the flags
    assert cpu_build.cache_key(cpu_build.BASELINE_VARIANT, "gcc-13", str(src)) != key
