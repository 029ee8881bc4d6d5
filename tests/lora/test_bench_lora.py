"""`aioengine bench lora` end to end on the tiny model: it runs, registers its 4 random
adapters, and the report holds its two ratios and the machine it ran on."""
from __future__ import annotations

import json
import math

from aioengine.bench import main as bench_main


def test_bench_lora_runs(lora_model_dir, tmp_path, bench_threads) -> None:
    out = tmp_path / "lora.json"
    assert bench_main(["lora", "--model", str(lora_model_dir), "--dtype", "float32",
                       "--rounds", "1", "--num-prompts", "2", "--output-len", "6",
                       "--max-model-len", "512", "--save-json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    for key in ("w1_ratio", "tpot_ratio"):
        assert math.isfinite(summary[key]) and summary[key] > 0
    assert [len(report["w1"][k]) for k in ("base", "lora")] == [1, 1]
    assert report["lora_stats"]["lora_num_registered"] == 4
    assert report["environment"]["cpu_model"]
