"""The seams of the model code, checked on its source: layer code never asks which device
it runs on nor which attention backend it has (the device ops and the executors decide,
aioengine/model/ops.py and executors.py), and every executor declares the layer features
it runs."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The layer code: what runs a layer's math. Device and backend choices live elsewhere.
LAYER_CODE = ("aioengine/model/llama.py", "aioengine/model/rotary.py",
              "aioengine/model/layer_spec.py", "spec_decode/eagle.py", "lora/layers.py")


def device_branches(source: str) -> list[str]:
    """`x.is_cuda`, `<...>.device.type`, `isinstance(b, <...>Backend)` and
    `type(b) is <...>Backend` in `source`, as 'line: text'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Attribute):
            hit = node.attr == "is_cuda" or (
                node.attr == "type" and isinstance(node.value, ast.Attribute)
                and node.value.attr == "device")
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
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(set(found))]


@pytest.mark.parametrize("path", LAYER_CODE)
def test_layer_code_does_not_branch_on_the_device(path: str) -> None:
    assert device_branches((ROOT / path).read_text()) == []


def test_the_check_finds_each_kind_of_branch() -> None:
    source = ("if x.is_cuda: pass\n"
              "if x.device.type == 'cpu': pass\n"
              "if isinstance(b, TorchAttentionBackend): pass\n"
              "if type(b) is TorchAttentionBackend: pass\n"
              "y = ops.rms_norm(x, w, eps)\n")
    assert [hit.split(":")[0] for hit in device_branches(source)] == ["1", "2", "3", "4"]


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
