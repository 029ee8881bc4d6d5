"""A draft head's weight storage (`speculative_config.quantization`): left out, int8 on the
CPU where the packed kernels run it, else the target's dtype; `none` keeps the target's
dtype; n-gram has no head to quantize."""
from __future__ import annotations

import pytest
import torch

from aioengine.config import ConfigError
from aioengine.kernels import cpu_build
from aioengine.spec_decode import head_weight_storage
from aioengine.spec_decode.config import SpeculativeConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_quantization_is_parsed_for_heads_only() -> None:
    assert SpeculativeConfig.parse({"method": "eagle3"}).quantization == "auto"
    for value in ("auto", "int8", "none"):
        spec = SpeculativeConfig.parse({"method": "eagle", "quantization": value})
        assert spec.quantization == value
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(ngram).quantization is None
    with pytest.raises(ConfigError, match="quantization is not used by method 'ngram'"):
        SpeculativeConfig.parse({**ngram, "quantization": "int8"})
    for bad in ("fp8", "gguf", 8, True):
        with pytest.raises(ConfigError, match=r"quantization \(the draft head's weights\)"):
            SpeculativeConfig.parse({"method": "eagle3", "quantization": bad})


def test_auto_takes_int8_only_where_the_cpu_kernels_run_it(monkeypatch) -> None:
    monkeypatch.setattr(cpu_build, "load", lambda: object())
    assert head_weight_storage("auto", torch.bfloat16, CPU) == "int8"
    assert head_weight_storage(None, torch.float32, CPU) == "int8"
    assert head_weight_storage("none", torch.bfloat16, CPU) == "bfloat16"
    assert head_weight_storage("auto", torch.bfloat16, CUDA) == "bfloat16"
    assert head_weight_storage("int8", torch.bfloat16, CUDA) == "int8"
    monkeypatch.setattr(cpu_build, "load", lambda: None)  # no kernel library
    assert head_weight_storage("auto", torch.float32, CPU) == "float32"
    assert head_weight_storage("int8", torch.float32, CPU) == "int8"
