"""The feature seam, checked on the source: the scheduler (aioengine/sched/), the model
runner (aioengine/worker/) and speculative decoding (spec_decode/) never read a feature's
per-request state (`request.feature_state`, `request.lora_request`, `request.lora_id`);
they reach structured output and LoRA through the EngineFeature hooks only
(aioengine/engine/features.py). Within the engine only features.py (which fills it at
admission) and the feature folders touch `feature_state`, and EngineCore names no feature
in add_request: it loops over them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FEATURE_STATE = ("feature_state", "structured", "lora_request", "lora_id")
FEATURE_BLIND = ("aioengine/sched", "aioengine/kv", "aioengine/worker", "spec_decode")
# Where per-request feature state may be named: the protocol that fills it, the Request
# that holds it, and the features' own folders.
STATE_OWNERS = ("aioengine/engine/features.py", "aioengine/request.py", "structured/", "lora/")


def feature_state_reads(source: str, attrs: tuple[str, ...] = FEATURE_STATE) -> list[str]:
    """Each `x.<attr>` of `attrs` in `source`, as 'line: text'."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in attrs]


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def test_the_checker_finds_feature_state() -> None:
    assert len(feature_state_reads("if request.structured is None: pass")) == 1
    assert len(feature_state_reads("s = request.feature_state.get('structured')")) == 1
    assert len(feature_state_reads("loras = {r.lora_id for r in running}")) == 1
    assert len(feature_state_reads("x = item.request.lora_request.lora_int_id")) == 1
    assert feature_state_reads("from aioengine.structured import GrammarBitmask") == []
    assert feature_state_reads("f.can_admit(request)") == []


def test_the_scheduler_the_runner_and_drafts_use_only_feature_hooks() -> None:
    files = _sources(*FEATURE_BLIND)
    assert {"scheduler.py", "model_runner.py", "tree.py"} <= {p.name for p in files}
    found = {str(p.relative_to(ROOT)): hits for p in files
             if (hits := feature_state_reads(p.read_text()))}
    assert not found, f"reach features through EngineFeature hooks: {found}"


def test_only_the_features_name_their_per_request_state() -> None:
    files = _sources("aioengine", "spec_decode", "structured", "lora")
    found = {rel: hits for p in files
             if not (rel := str(p.relative_to(ROOT))).startswith(STATE_OWNERS)
             and (hits := feature_state_reads(p.read_text(), ("feature_state",)))}
    assert not found, f"ask the feature (a hook or its typed accessor): {found}"


def test_add_request_names_no_feature() -> None:
    """EngineCore.add_request admits each sample through the features' loop."""
    tree = ast.parse((ROOT / "aioengine/engine/core.py").read_text())
    add_request = next(n for n in ast.walk(tree)
                       if isinstance(n, ast.FunctionDef) and n.name == "add_request")
    named = {n.attr for n in ast.walk(add_request) if isinstance(n, ast.Attribute)}
    assert "features" in named
    assert not named & {"structured", "lora", "spec_decode"}, named
