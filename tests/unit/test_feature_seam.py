"""The feature seam, checked on the source: the scheduler (aioengine/core/) and the model
runner (aioengine/worker/) never read a feature's per-request state (`request.structured`,
`request.lora_request`, `request.lora_id`); they reach structured output and LoRA through
the EngineFeature hooks only (aioengine/engine/features.py)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FEATURE_STATE = ("structured", "lora_request", "lora_id")
FEATURE_BLIND = ("aioengine/core", "aioengine/worker")


def feature_state_reads(source: str) -> list[str]:
    """Each `x.structured` / `x.lora_request` / `x.lora_id` in `source`, as 'line: text'."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in FEATURE_STATE]


def test_the_checker_finds_feature_state() -> None:
    assert len(feature_state_reads("if request.structured is None: pass")) == 1
    assert len(feature_state_reads("loras = {r.lora_id for r in running}")) == 1
    assert len(feature_state_reads("x = item.request.lora_request.lora_int_id")) == 1
    assert feature_state_reads("from aioengine.structured import GrammarBitmask") == []
    assert feature_state_reads("f.can_admit(request)") == []


def test_the_scheduler_and_the_runner_use_only_feature_hooks() -> None:
    files = [p for folder in FEATURE_BLIND for p in sorted((ROOT / folder).rglob("*.py"))]
    assert any(p.name == "scheduler.py" for p in files)
    assert any(p.name == "model_runner.py" for p in files)
    found = {str(p.relative_to(ROOT)): hits for p in files
             if (hits := feature_state_reads(p.read_text()))}
    assert not found, f"reach features through EngineFeature hooks: {found}"
