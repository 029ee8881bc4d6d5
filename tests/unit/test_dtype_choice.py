"""dtype="auto" on the CPU follows the processor's flags; bad dtype, quantization and KV
cache settings are refused with errors that name them."""
from __future__ import annotations

import pytest
import torch

from aioengine import cpu_info
from aioengine.config import ConfigError, EngineArgs
from aioengine.dtypes import auto_dtype, parse_dtype
from aioengine.kernels import cpu as cpu_kernels

CPU = torch.device("cpu")


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch):
    """flags(set): what cpu_info reports for the rest of the test (the decision logic for
    CPUs this machine is not; the real flags are restored after)."""
    def set_flags(value: set[str]) -> None:
        monkeypatch.setattr(cpu_info, "_cpuinfo", lambda: ("Test CPU", frozenset(value)))
    return set_flags


AVX2 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize("cpu,dtype,variant", [
    (AVX2, torch.float32, "avx2"),
    (AVX512, torch.float32, "avx512"),
    (AVX512 | {"avx512_bf16", "avx512_vnni"}, torch.bfloat16, "avx512_bf16"),
    (AVX2 | {"amx_bf16"}, torch.bfloat16, "avx2"),
    (set(), torch.float32, "baseline"),
])
def test_auto_follows_the_flags(flags, cpu, dtype, variant) -> None:
    flags(cpu)
    chosen, why = auto_dtype(CPU)
    assert chosen == dtype == parse_dtype("auto", CPU)
    assert ("no native bf16" in why) == (dtype == torch.float32)
    assert cpu_kernels.supported_variants()[0] == variant


def test_the_real_cpu_is_reported() -> None:
    assert cpu_info.cpu_model() and isinstance(cpu_info.relevant_flags(), list)
    assert set(cpu_info.relevant_flags()) <= cpu_info.cpu_flags()


def test_cuda_is_bf16() -> None:
    assert auto_dtype(torch.device("cuda"))[0] == torch.bfloat16


@pytest.mark.parametrize("kwargs,field", [(dict(quantization="int4"), "quantization"),
                                          (dict(kv_cache_dtype="float16"), "kv_cache_dtype"),
                                          (dict(kv_cache_dtype="fp8"), "kv_cache_dtype")])
def test_bad_settings_name_the_field(kwargs, field) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineArgs(**kwargs).validate()


def test_bad_dtype() -> None:
    with pytest.raises(ConfigError, match="unsupported dtype 'int8'"):
        parse_dtype("int8", CPU)
