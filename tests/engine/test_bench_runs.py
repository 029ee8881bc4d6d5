"""`aioengine bench latency` and `offline` run for real on a tiny random-weight Llama,
checked through their saved JSON and printed tables."""
from __future__ import annotations

import json
import os
import statistics
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from aioengine.bench import main as bench_main
from aioengine.bench.gemm_ceiling import step_rows
from aioengine.bench.floor import weight_bytes_per_token
from aioengine.model.loader import load_model

from tests.tiny_models import make_tiny_model_dir


def _safetensors_data_bytes(path: Path) -> int:
    """Tensor bytes of a safetensors file: its size minus the 8-byte length and the header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(path) - 8 - header_len


def _embedding_bytes(model_dir: Path) -> tuple[int, int]:
    """(whole table, one row) of the float32 embedding, from the checkpoint's config."""
    config = json.loads((model_dir / "config.json").read_text())
    row = config["hidden_size"] * 4
    return config["vocab_size"] * row, row


def test_latency_mode_measures_the_floor_and_both_engines(
        tiny_llama_dir: Path, tmp_path: Path, bench_threads, capsys) -> None:
    path = tmp_path / "latency.json"
    # No speculation: accepted drafts arrive together, and the test checks the ITL's stats.
    rc = bench_main(["latency", "--model", str(tiny_llama_dir), "--dtype", "float32", "--input-len", "20",
                     "--output-len", "6", "--repeats", "2", "--warmup", "1", "--threads", "2",
                     "--speculative-config", "none",
                     "--bandwidth-mib", "64", "--save-json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    floor = report["floor"]
    assert floor["bandwidth_gb_per_s"] > 0 and floor["bandwidth_buffer_bytes"] == 64 << 20
    # The tiny Llama ties its embedding and LM head: the checkpoint stores the table once,
    # so every stored byte is read per token.
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert floor["weight_bytes"] == _safetensors_data_bytes(tiny_llama_dir / "model.safetensors")
    assert floor["floor_ms"] == pytest.approx(
        floor["weight_bytes"] / (floor["bandwidth_gb_per_s"] * 1e9) * 1e3)
    assert report["workload"]["prompt_len_min"] == report["workload"]["prompt_len_max"] == 20
    for name in ("aioengine", "hf"):
        r = report["results"][name]
        assert r["num_runs"] == 2 and [run["num_tokens"] for run in r["runs"]] == [6, 6]
        for key in ("ttft_ms", "tpot_ms", "itl_median_ms", "e2e_ms"):
            assert 0 < r[key]["best"] <= r[key]["median"]
        for run in r["runs"]:
            assert run["tpot_ms"] == pytest.approx((run["e2e_ms"] - run["ttft_ms"]) / 5)
    # Each run's ratio uses the bandwidth measured just before it; the floor is their median.
    runs = [run for name in ("aioengine", "hf") for run in report["results"][name]["runs"]]
    assert all(run["bandwidth_gb_per_s"] > 0 for run in runs)
    assert floor["bandwidth_gb_per_s"] == pytest.approx(
        statistics.median(run["bandwidth_gb_per_s"] for run in runs))
    for run in report["results"]["aioengine"]["runs"]:
        assert run["tpot_over_floor"] == pytest.approx(
            run["tpot_ms"] / (floor["weight_bytes"] / (run["bandwidth_gb_per_s"] * 1e9) * 1e3))
    assert report["tpot_over_floor"] == report["results"]["aioengine"]["tpot_over_floor"]
    ratios = [run["tpot_over_floor"] for run in report["results"]["aioengine"]["runs"]]
    assert report["tpot_over_floor"]["median"] == pytest.approx(statistics.median(ratios))
    ours = report["results"]["aioengine"]["tpot_ms"]
    hf = report["results"]["hf"]["tpot_ms"]
    assert report["speedup_vs_hf"]["median"] == pytest.approx(hf["median"] / ours["median"])
    text = capsys.readouterr().out
    assert "weight-streaming floor" in text and "aioengine speed-up vs hf" in text
    assert "target: aioengine TPOT <= 1.4 x floor:" in text


def test_weight_bytes_count_an_untied_embedding_as_one_row(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir("llama3", tmp_path / "llama3")  # untied embedding
    loaded = load_model(str(model_dir), torch.float32, torch.device("cpu"))
    stored = _safetensors_data_bytes(model_dir / "model.safetensors")
    table, row = _embedding_bytes(model_dir)
    # Stored: embedding + LM head + the rest; read per token: one embedding row + the rest.
    assert weight_bytes_per_token(loaded.model) == stored - table + row


def test_offline_prefix_caching_a_b_with_kv_stats(
        tiny_llama_dir: Path, tmp_path: Path, bench_threads, capsys) -> None:
    path = tmp_path / "offline.json"
    rc = bench_main(["offline", "--model", str(tiny_llama_dir), "--dataset", "shared-prefix",
                     "--num-prefixes", "2", "--prefix-len", "32", "--suffix-len", "8",
                     "--num-prompts", "4", "--output-len", "4", "--threads", "2",
                     "--engines", "aioengine,aioengine-no-prefix-caching", "--no-progress",
                     "--save-json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    ours = report["results"]["aioengine"]["engine_stats"]
    # 4 prompts of 32 + 8 tokens, blocks of 16, all prefilled in the first step: the
    # second user of each prefix hits its 2 full blocks (the warm-up's cache was reset).
    assert (ours["prefix_cache_queries"], ours["prefix_cache_hits"]) == (160, 64)
    assert ours["prefix_cache_hit_rate"] == 0.4 and ours["num_preemptions"] == 0
    # Peak (step 1): 2 shared + 2 own blocks per prefix = 8 blocks, 128 slots, 96 tokens.
    assert (ours["kv_peak_blocks"], ours["kv_waste_at_peak"]) == (8, 0.25)
    theirs = report["results"]["aioengine-no-prefix-caching"]["engine_stats"]
    assert (theirs["prefix_cache_queries"], theirs["prefix_cache_hit_rate"]) == (0, None)
    # 3 private blocks per request: 12 blocks, 192 slots, 160 tokens.
    assert (theirs["kv_peak_blocks"], theirs["kv_waste_at_peak"]) == (12, 32 / 192)
    ratio = report["ratios"]["aioengine-no-prefix-caching"]
    assert ratio["output"] > 0 and ratio["total"] > 0
    text = capsys.readouterr().out
    assert "aioengine / aioengine-no-prefix-caching: output x" in text
    assert "aioengine-no-prefix-caching        4" in text  # the engine column fits the name
    assert "   40.0%       0    25.0%" in text  # hit rate, preemptions, KV waste


def test_onednn_ceiling_steps_follow_the_scheduler_budget() -> None:
    """1,100 prompt tokens in 512-token chunks, the LM head once per request at the end of
    its prompt, then 7 decode steps of every request's row (at most max_num_seqs)."""
    requests = [SimpleNamespace(prompt_len=n, output_len=8) for n in (300, 500, 300)]
    workload = SimpleNamespace(requests=requests, num_prompt_tokens=1100)
    layers, head = step_rows(workload, max_num_batched_tokens=512, max_num_seqs=64)
    assert layers == {512: 2, 76: 1, 3: 7} and head == {3: 8}
    layers, head = step_rows(workload, max_num_batched_tokens=1100, max_num_seqs=2)
    assert layers == {1100: 1, 2: 7} and head == {3: 1, 2: 7}


def test_offline_onednn_ceiling_beside_our_engine(
        tiny_llama_dir: Path, tmp_path: Path, bench_threads, capsys) -> None:
    path = tmp_path / "offline.json"
    rc = bench_main(["offline", "--model", str(tiny_llama_dir), "--num-prompts", "4",
                     "--input-len-min", "8", "--input-len-max", "24", "--output-len", "4",
                     "--threads", "2", "--engines", "aioengine,onednn", "--no-progress",
                     "--save-json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    ceiling = report["results"]["onednn"]
    assert ceiling["elapsed_s"] > 0 and ceiling["num_output_tokens"] == 16
    assert ceiling["engine_stats"] is None and "onednn" not in report["agreement"]
    assert report["ratios"]["onednn"]["total"] > 0
    text = capsys.readouterr().out
    assert "aioengine / onednn: output x" in text
    assert "greedy outputs equal to onednn" not in text


def test_profile_mode_records_every_step_of_the_workload(
        tiny_llama_dir: Path, tmp_path: Path, bench_threads, capsys) -> None:
    path = tmp_path / "profile.json"
    rc = bench_main(["profile", "--model", str(tiny_llama_dir), "--dtype", "float32",
                     "--num-prompts", "3", "--input-len-min", "12", "--input-len-max", "20",
                     "--output-len", "5", "--no-enable-prefix-caching",
                     "--save-json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    steps = report["steps"]
    # Every request's prompt and output tokens went through recorded steps (the warm-up's
    # were not recorded, and with prefix caching off none of its blocks are reused): 3
    # requests' prompts, then one token per request per decode step.
    prompt_tokens = report["workload"]["num_prompt_tokens"]
    decode_tokens = 3 * (5 - 1)  # the first output token comes from the prefill step
    assert sum(s["num_tokens"] for s in steps) == prompt_tokens + decode_tokens
    summary = report["summary"]
    assert summary["all"]["steps"] == len(steps)
    assert sum(summary[k]["steps"] for k in ("prefill", "mixed", "decode") if k in summary) \
        == len(steps)
    assert summary["decode"]["tokens_per_step"] <= 3
    for row in summary.values():
        assert row["forward_ms"] > 0 and 0 <= row["overlap"] <= 1
    text = capsys.readouterr().out
    assert "phase (mean ms/step)" in text and "forward_ms" in text
    # Each request's times in order, on the steps' clock; each step's rows add up.
    requests = report["requests"]
    assert len(requests) == 3
    for r in requests:
        assert r["arrival"] <= r["scheduled"] <= r["outputs"][0] <= r["finish"]
        assert len(r["outputs"]) >= 1 and r["num_prompt_tokens"] >= 12
    assert all(report["origin"] <= s["start"] for s in steps)
    assert all(0 <= s["decode_rows"] + s["draft_tokens"] <= s["num_tokens"] for s in steps)
    assert sum(s["decode_rows"] for s in steps) >= decode_tokens


def test_profile_mode_draws_its_run(tiny_llama_dir: Path, tmp_path: Path,
                                    bench_threads) -> None:
    """--plot: the PNG and the self-contained HTML beside it (the PNG inside, the table)."""
    png = tmp_path / "run.png"
    rc = bench_main(["profile", "--model", str(tiny_llama_dir), "--dtype", "float32",
                     "--num-prompts", "3", "--input-len-min", "12", "--input-len-max", "20",
                     "--output-len", "5", "--plot", str(png),
                     "--save-json", str(tmp_path / "a.json")])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    page = (tmp_path / "run.html").read_text()
    assert "phase (mean ms/step)" in page and "data:image/png;base64," in page
    assert "src='http" not in page and "href=" not in page  # nothing fetched from elsewhere
    # bench compare: two saved runs side by side (here the same run under two names).
    (tmp_path / "b.json").write_text((tmp_path / "a.json").read_text())
    both = tmp_path / "both.png"
    assert bench_main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--plot", str(both)]) == 0
    assert both.stat().st_size > 20_000
    assert "b / a: 1.000x the time" in (tmp_path / "both.html").read_text()
    # The spelling, `bench --compare A B`, is the same mode.
    flag = tmp_path / "flag.png"
    assert bench_main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--plot", str(flag)]) == 0
    assert flag.stat().st_size > 20_000
    assert "b / a: 1.000x the time" in (tmp_path / "flag.html").read_text()
    (tmp_path / "offline.json").write_text('{"mode": "offline"}')
    with pytest.raises(SystemExit, match="not a `bench profile --save-json` report"):
        bench_main(["compare", str(tmp_path / "a.json"), str(tmp_path / "offline.json"),
                    "--plot", str(both)])
