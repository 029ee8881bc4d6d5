"""`aioengine bench structured` end to end on a tiny random-weight Llama: forward steps are
counted (from the engine's step timeline) and jump-forward saves some."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from aioengine.bench import build_parser
from aioengine.bench import main as bench_main

from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny_structured"), seed=3)


def test_command_line_defaults() -> None:
    args = build_parser().parse_args(["structured"])
    assert (args.num_prompts, args.output_len, args.repeats) == (16, 96, 3)
    assert args.num_kv_blocks == 1024 and args.structured_jump_forward is True


def test_bench_structured_counts_steps_and_steps_saved(tiny_dir: Path, tmp_path: Path,
                                                       capsys) -> None:
    out = tmp_path / "structured.json"
    assert bench_main(["structured", "--model", str(tiny_dir), "--dtype", "float32",
                       "--num-prompts", "2", "--output-len", "16", "--repeats", "1",
                       "--save-json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = [report[k] for k in ("unconstrained", "json_schema_no_jump_forward",
                                "json_schema_jump_forward")]
    # The old benchmark counted steps by patching a method the step worker no longer
    # calls, and reported 0 steps and 0 saved.
    assert all(r["steps"] > 0 for r in runs)
    assert report["jump_forward_tokens"] > 0 and report["forward_steps_saved"] > 0
    assert report["forward_steps_saved"] == runs[1]["steps"] - runs[2]["steps"]
    # Each request computes one token per step without jump-forward (both at once).
    assert runs[1]["steps"] >= runs[1]["mean_tokens"]
    assert all(math.isfinite(r["tpot_ms"]) and r["tpot_ms"] > 0 for r in runs)
    assert set(report["compile_ms"]) == {"json", "json_object", "regex", "choice", "grammar"}
    text = capsys.readouterr().out
    assert "forward steps saved by jump-forward:" in text
    from aioengine.structured.bitmask import GrammarBitmask

    # The bitmask timing is undone afterwards.
    assert (GrammarBitmask.fill.__name__, GrammarBitmask.apply.__name__) == ("fill", "apply")
