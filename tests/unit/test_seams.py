"""The seams of the model code, checked on its source: layer code never asks which device
it runs on nor which attention backend it has (the device ops and the executors decide,
aioengine/model/ops.py and executors.py), and every executor declares the layer features
it runs."""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
# The layer code: what runs a layer's math. Device and backend choices live elsewhere.
LAYER_CODE = ("aioengine/model/llama.py", "aioengine/model/decoder_layer.py",
              "aioengine/model/moe.py", "aioengine/model/rotary.py",
              "aioengine/model/rope_variants.py", "aioengine/model/layer_spec.py",
              "aioengine/model/softcap_attention.py", "spec_decode/eagle.py", "lora/layers.py")
# Modules that define an nn.Module yet are device choices, not layer code, and why.
DEVICE_CHOICES = {
    "aioengine/model/layers.py": "Linear picks its matmul kernel (the C GEMM, oneDNN, torch) "
                                 "by the input's device and dtype, as the device ops do"}
# Device branches left in layer code, by file and source line, and why.
ALLOWED: dict[tuple[str, str], str] = {}
# The packages holding model code (their modules, not subpackages: spec_decode/train is
# the draft head's training code, which the engine never runs).
PACKAGES = ("aioengine.model", "aioengine.spec_decode", "aioengine.lora")


def device_branches(source: str) -> list[tuple[int, str]]:
    """`x.is_cuda`, `x.is_cpu`, a `.type` read on anything (a device's: `x.device.type`,
    `dev.type`, `torch.device(d).type`; layer code reads no other `.type`),
    `isinstance(b, <...>Backend)` and `type(b) is <...>Backend` in `source`, as (line,
    text)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Attribute):
            hit = node.attr in ("is_cuda", "is_cpu", "type")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "isinstance" and len(node.args) == 2:
                hit = "Backend" in ast.unparse(node.args[1])
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.Eq))
                                                   for op in node.ops):
            left = node.left
            hit = (isinstance(left, ast.Call) and isinstance(left.func, ast.Name)
                   and left.func.id == "type"
                   and any("Backend" in ast.unparse(c) for c in node.comparators))
        if hit:
            found.add((node.lineno, ast.unparse(node)))
    return sorted(found)


def files_defining_modules() -> set[str]:
    """The files (relative to the repository) of PACKAGES' modules that define an
    nn.Module: every layer, and anything else that could hold one's math."""
    found = set()
    for package in PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            if info.ispkg:
                continue
            module = importlib.import_module(f"{package}.{info.name}")
            if any(isinstance(v, type) and issubclass(v, nn.Module)
                   and v.__module__ == module.__name__ for v in vars(module).values()):
                found.add(Path(module.__file__).resolve().relative_to(ROOT).as_posix())
    return found


@pytest.mark.parametrize("path", LAYER_CODE)
def test_layer_code_does_not_branch_on_the_device(path: str) -> None:
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    hits = [(line, lines[line - 1].strip()) for line, _ in device_branches(source)]
    assert [f"{line}: {text}" for line, text in hits if (path, text) not in ALLOWED] == []


def test_every_file_holding_a_layer_is_checked() -> None:
    """A new module defining a layer is layer code or a named device choice, never neither."""
    assert files_defining_modules() - set(DEVICE_CHOICES) <= set(LAYER_CODE)
    assert set(DEVICE_CHOICES) <= files_defining_modules()  # no stale entries
    assert {path for path, _ in ALLOWED} <= set(LAYER_CODE)


def test_the_check_finds_each_kind_of_branch() -> None:
    source = ("if x.is_cuda: pass\n"
              "if x.device.type == 'cpu': pass\n"
              "if isinstance(b, TorchAttentionBackend): pass\n"
              "if type(b) is TorchAttentionBackend: pass\n"
              "if dev.type == 'cuda': pass\n"
              "if torch.device(d).type != 'cpu': pass\n"
              "if x.is_cpu: pass\n"
              "y = ops.rms_norm(x, w, eps).to(x.dtype)\n")
    assert sorted({line for line, _ in device_branches(source)}) == [1, 2, 3, 4, 5, 6, 7]


def test_every_executor_and_backend_declares_its_features() -> None:
    from aioengine.model.attention import AttentionBackend, TorchAttentionBackend
    from aioengine.model.executors import FusedCpuDecodeExecutor
    from aioengine.model.layer_spec import SHAPE_FIELDS, LayerSpec
    from aioengine.model.triton_attention import TritonAttentionBackend

    options = {f for f in LayerSpec.__dataclass_fields__ if f not in SHAPE_FIELDS}
    for declared in (FusedCpuDecodeExecutor.SUPPORTED_FEATURES,
                     AttentionBackend.SUPPORTED_FEATURES,
                     TorchAttentionBackend.SUPPORTED_FEATURES,
                     TritonAttentionBackend.SUPPORTED_FEATURES):
        assert declared <= options  # no stale names
    assert "sliding_window" not in TritonAttentionBackend.SUPPORTED_FEATURES
