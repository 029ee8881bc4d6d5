"""The benchmark's pure parts: metric maths, report formatting and the command
line (no model runs; the serving client is in test_bench_serve_client.py)."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from aioengine.bench import build_parser
from aioengine.bench.datasets import random_dataset
from aioengine.bench.floor import BandwidthProbe, measure_read_bandwidth
from aioengine.bench.latency import format_latency, parse_latency_engines
from aioengine.bench.metrics import (RequestResult, latency_stats, meets_slo, parse_slo,
                                     summarize, throughput_over_time)
from aioengine.bench.offline import compare_outputs, engine_stats, parse_engines
from aioengine.bench.report import format_offline, format_serve, save_json
from aioengine.bench.results import EngineLatency, LatencyRun
from aioengine.metrics import (SPEC_PER_POS_PREFIX, EngineMetrics, format_spec_decode,
                               spec_method_key,
                               spec_decode_delta)
from tests.unit.bench_reports import VOCAB, offline_report


def _result(ttft: float, chunks: list[float], tokens: int, start: float = 0.0) -> RequestResult:
    return RequestResult(success=True, prompt_len=10, output_tokens=tokens, start_s=start,
                         ttft_s=ttft, e2e_s=chunks[-1], chunk_times_s=chunks)


def test_latency_stats_percentiles() -> None:
    s = latency_stats([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s["mean_ms"] == pytest.approx(3000.0)
    assert s["p50_ms"] == pytest.approx(3000.0)
    assert s["p90_ms"] == pytest.approx(4600.0)  # linear: 4 + 0.6 * (5 - 4)
    assert s["p99_ms"] == pytest.approx(4960.0)
    assert s["std_ms"] == pytest.approx(1000.0 * math.sqrt(2.0))
    assert latency_stats([]) == {"mean_ms": 0.0, "std_ms": 0.0, "p50_ms": 0.0,
                                 "p90_ms": 0.0, "p99_ms": 0.0}


def test_tpot_itl_and_summary() -> None:
    a = _result(0.5, [0.5, 0.7, 1.0, 1.1], tokens=4)
    b = _result(0.2, [0.2, 0.6], tokens=5)  # 5 tokens in 2 chunks: TPOT counts tokens
    single = _result(0.3, [0.3], tokens=1)
    failed = RequestResult(success=False, error="HTTP 500", prompt_len=10)
    assert a.itls_s == pytest.approx([0.2, 0.3, 0.1])
    assert a.tpot_s == pytest.approx(0.6 / 3)
    assert b.tpot_s == pytest.approx(0.4 / 4)
    assert single.tpot_s is None and single.itls_s == []
    b.cached_tokens = 6
    s = summarize([a, b, single, failed], duration_s=2.0)
    assert (s["successful_requests"], s["failed_requests"]) == (3, 1)
    assert s["total_output_tokens"] == 10 and s["total_input_tokens"] == 30
    assert s["total_cached_tokens"] == 6 and s["prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(20.0)
    assert s["ttft"]["mean_ms"] == pytest.approx(1000 / 3)
    assert s["tpot"]["mean_ms"] == pytest.approx((200 + 100) / 2)  # `single` has no TPOT
    assert s["itl"]["p50_ms"] == pytest.approx(250.0)  # of 200, 300, 100, 400
    assert "request_goodput" not in s


def test_goodput_against_slo() -> None:
    slo = parse_slo("ttft:400,tpot:150")
    assert slo == {"ttft": pytest.approx(0.4), "tpot": pytest.approx(0.15)}
    fast = _result(0.2, [0.2, 0.3, 0.4], tokens=3)  # TPOT 100 ms
    slow_first = _result(0.5, [0.5, 0.6], tokens=2)  # TTFT 500 ms
    slow_decode = _result(0.1, [0.1, 0.5], tokens=2)  # TPOT 400 ms
    single = _result(0.3, [0.3], tokens=1)  # no TPOT: meets any TPOT bound
    failed = RequestResult(success=False)
    assert [meets_slo(r, slo) for r in (fast, slow_first, slow_decode, single, failed)] == \
        [True, False, False, True, False]
    s = summarize([fast, slow_first, slow_decode, single, failed], 4.0, slo)
    assert s["goodput_requests"] == 2 and s["request_goodput"] == pytest.approx(0.5)
    assert meets_slo(fast, parse_slo("e2el:300")) is False
    for bad in ("ttft", "foo:10", "ttft:0", "tpot:-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    assert parse_slo(None) == {} and parse_slo("") == {}


def test_throughput_over_time_conserves_tokens() -> None:
    rs = [_result(0.1, [0.1, 0.6, 1.1], tokens=6, start=0.0),
          _result(0.2, [0.2, 0.4], tokens=2, start=1.5)]
    centres, tps = throughput_over_time(rs, duration_s=2.0, num_bins=4)
    assert centres == pytest.approx([0.25, 0.75, 1.25, 1.75])
    assert tps == pytest.approx([4.0, 4.0, 4.0, 4.0])  # 2 tokens land in each 0.5 s bin
    assert sum(t * 0.5 for t in tps) == pytest.approx(8.0)


# ---- reports and command line ----------------------------------------------------------


def _serve_report() -> dict:
    rs = [_result(0.1, [0.1, 0.2, 0.3], tokens=3), _result(0.2, [0.2, 0.4, 0.6], tokens=3)]
    return {"mode": "serve", "model": "m",
            "config": {"base_url": "http://x", "endpoint": "completions",
                       "max_concurrency": 2, "request_rate": math.inf, "burstiness": 1.0},
            "workload": random_dataset(VOCAB, 2, 4, 4, 3, seed=0).summary(),
            "summary": summarize(rs, 1.0, parse_slo("ttft:150")),
            "requests": [r.to_json() for r in rs]}


def test_format_serve_and_json(tmp_path) -> None:
    report = _serve_report()
    text = format_serve(report)
    lines = text.splitlines()
    assert lines[0].startswith("workload: 2 random-token prompts of 4-4 tokens (8 in all)")
    assert "Successful requests:                             2" in lines
    assert "Request goodput (req/s):                      1.00" in lines
    assert "Mean TTFT (ms):                             150.00" in lines
    assert "P50 ITL (ms):                               150.00" in lines
    assert all(len(line) == 50 for line in lines[2:] if not line.startswith("  ("))
    path = tmp_path / "r.json"
    save_json(str(path), report)
    loaded = json.loads(path.read_text())  # inf request rate becomes null, still valid JSON
    assert loaded["config"]["request_rate"] is None
    assert loaded["requests"][1]["tpot_s"] == pytest.approx(0.2)


def test_format_offline_ratios_and_skips() -> None:
    results = {"aioengine": {"num_requests": 2, "num_prompt_tokens": 8, "num_output_tokens": 6,
                             "elapsed_s": 1.0, "output_tok_per_s": 6.0, "total_tok_per_s": 14.0},
               "hf": {"num_requests": 2, "num_prompt_tokens": 8, "num_output_tokens": 6,
                      "elapsed_s": 2.0, "output_tok_per_s": 3.0, "total_tok_per_s": 7.0}}
    agreement = compare_outputs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert agreement.num_equal == 1 and agreement.first_diffs == {1: 1}
    report = {"environment": {"torch": "t", "transformers": "x", "torch_threads": 2,
                              "cpu_count": 2, "cuda": None},
              "model": "m", "workload": random_dataset(VOCAB, 2, 4, 4, 3, seed=0).summary(),
              "results": results, "skipped": {"hf-cb": "RuntimeError: no"},
              "ratios": {"hf": {"output": 2.0, "total": 2.0}},
              "agreement": {"hf": {"num_equal": 1, "num_requests": 2, "first_diffs": {1: 1},
                                   "mean_first_diff": 1.0}}}
    text = format_offline(report)
    assert "aioengine / hf: output x2.00, total x2.00" in text
    assert "hf-cb      skipped: RuntimeError: no" in text
    assert "greedy outputs equal to hf: 1/2 (differing ones diverge at token 1.0" in text


def test_command_line() -> None:
    assert parse_engines("aioengine, hf-cb") == ["aioengine", "hf-cb"]
    for bad in ("", "nope", "hf,hf"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_engines(bad)
    args = build_parser().parse_args(["serve", "--base-url", "http://x", "--dataset",
                                      "shared-prefix", "--request-rate", "2.5"])
    assert (args.request_rate, args.num_prefixes, args.prefix_len) == (2.5, 8, 512)
    args = build_parser().parse_args(["offline"])
    assert args.engines == ["aioengine", "hf", "hf-cb"] and args.dataset == "random"
    assert (args.num_prompts, args.input_len_min, args.input_len_max, args.output_len) == \
        (32, 32, 256, 64)


def test_aioengine_cli_forwards_bench(capsys) -> None:
    from aioengine.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "serve", "--help"])
    assert exit_info.value.code == 0
    assert "--base-url" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "serve"])  # --base-url is required
    assert exit_info.value.code == 2


def test_engine_stats_are_deltas_over_the_timed_run() -> None:
    before = {"prefix_cache_queries": 100, "prefix_cache_hits": 40, "num_preemptions": 1,
              "kv_peak_blocks": 0, "num_blocks": 64, "kv_waste_at_peak": 0.0}
    after = {**before, "prefix_cache_queries": 300, "prefix_cache_hits": 190,
             "num_preemptions": 3, "kv_peak_blocks": 20, "kv_waste_at_peak": 0.125}
    stats = engine_stats(before, after)
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (200, 150)
    assert stats["prefix_cache_hit_rate"] == 0.75 and stats["num_preemptions"] == 2
    assert (stats["kv_peak_blocks"], stats["num_kv_blocks"], stats["kv_waste_at_peak"]) == \
        (20, 64, 0.125)
    assert engine_stats(before, before)["prefix_cache_hit_rate"] is None  # caching off


def test_format_offline_engine_stats_columns() -> None:
    row = {"num_requests": 2, "num_prompt_tokens": 8, "num_output_tokens": 6,
           "elapsed_s": 1.0, "output_tok_per_s": 6.0, "total_tok_per_s": 14.0}
    stats = {"prefix_cache_queries": 8, "prefix_cache_hits": 4, "prefix_cache_hit_rate": 0.5,
             "num_preemptions": 3, "kv_peak_blocks": 5, "num_kv_blocks": 64,
             "kv_waste_at_peak": 0.125}
    report = {"environment": {"torch": "t", "transformers": "x", "torch_threads": 2,
                              "cpu_count": 2, "cuda": None},
              "model": "m", "workload": random_dataset(VOCAB, 2, 4, 4, 3, seed=0).summary(),
              "results": {"aioengine": {**row, "engine_stats": stats},
                          "aioengine-no-prefix-caching": {**row, "engine_stats": {
                              **stats, "prefix_cache_hit_rate": None}},
                          "hf": {**row, "engine_stats": None}},
              "skipped": {}, "ratios": {}, "agreement": {}}
    lines = format_offline(report).splitlines()
    header = next(line for line in lines if line.startswith("engine"))
    assert header.endswith("hit rate preempt KV waste")
    ours = next(line for line in lines if line.startswith("aioengine "))
    assert ours.endswith("   50.0%       3    12.5%")
    assert lines[lines.index(ours) + 1].endswith("       -       3    12.5%")
    assert next(line for line in lines if line.startswith("hf ")).endswith("-       -        -")
    assert len({len(header), len(ours)}) == 1  # columns line up with the longest name
    assert "aioengine: peak 5 of 64 KV blocks in use; 4 of 8 prompt tokens hit" in lines[-2]
    assert lines[-1].endswith("prefix caching off")


# ---- speculative decoding -----------------------------------------------------------


def _spec_stats(drafts: int, drafted: int, accepted: int, per_pos: list[int],
                method: str = "ngram") -> dict:
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": drafted,
            "spec_decode_num_accepted_tokens": accepted,
            **{f"{SPEC_PER_POS_PREFIX}{i}": n for i, n in enumerate(per_pos)},
            **{spec_method_key(i, method): n for i, n in enumerate(per_pos)}}


def test_spec_decode_delta_and_line() -> None:
    before = _spec_stats(10, 30, 12, [7, 4, 1])
    after = _spec_stats(30, 90, 42, [17, 15, 10])
    d = spec_decode_delta(before, after)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (20, 60, 30)
    assert d["num_accepted_tokens_per_pos"] == [10, 11, 9]
    assert d["mean_acceptance_length"] == 2.5 and d["acceptance_rate"] == 0.5
    assert d["per_position_acceptance_rate"] == pytest.approx([0.5, 0.55, 0.45])
    assert spec_decode_delta({}, after)["num_accepted_tokens"] == 42  # since the start
    assert spec_decode_delta({}, {"num_running": 0}) is None  # not configured
    idle = spec_decode_delta(after, after)
    assert idle["mean_acceptance_length"] is None and idle["acceptance_rate"] is None
    assert format_spec_decode(d) == (
        "mean acceptance length 2.50, accepted 30 / drafted 60 tokens (50.0%) in 20 drafts, "
        "per-position acceptance rate [0.500, 0.550, 0.450]")
    assert format_spec_decode(idle) == "no drafts verified"


def test_spec_decode_prometheus_counters() -> None:
    stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
             "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}
    assert b"spec_decode" not in EngineMetrics("m", lambda: stats).render()
    current = {**stats, **_spec_stats(0, 0, 0, [0, 0])}
    metrics = EngineMetrics("m", lambda: current, num_speculative_tokens=2)
    assert 'aioengine:spec_decode_num_drafts_total{model_name="m"} 0.0' in \
        metrics.render().decode()
    current.update(_spec_stats(4, 8, 5, [3, 2]))
    metrics.render()
    current.update(_spec_stats(6, 12, 7, [4, 3]))  # cumulative: the counters follow
    text = metrics.render().decode()
    for line in ('aioengine:spec_decode_num_drafts_total{model_name="m"} 6.0',
                 'aioengine:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'aioengine:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'aioengine:spec_decode_num_accepted_tokens_per_pos_total{method="ngram",'
                 'model_name="m",position="0"} 4.0',
                 'aioengine:spec_decode_num_accepted_tokens_per_pos_total{method="ngram",'
                 'model_name="m",position="1"} 3.0'):
        assert line in text.splitlines(), line


def test_speculative_config_flag(capsys) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    for mode in (["latency"], ["offline"], ["profile"]):
        args = build_parser().parse_args([*mode, "--speculative-config", spec])
        assert args.speculative_config == json.loads(spec)
    from aioengine.config import engine_kwargs

    assert engine_kwargs(args)["speculative_config"] == json.loads(spec)
    # On by default (auto); "none" or JSON null turn it off, a method's name is its dict.
    assert build_parser().parse_args(["latency"]).speculative_config == "auto"
    for off in ("none", "null"):
        assert build_parser().parse_args(
            ["latency", "--speculative-config", off]).speculative_config is None
    assert build_parser().parse_args(
        ["latency", "--speculative-config", " suffix"]).speculative_config == "suffix"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["latency", "--speculative-config", '{"method": "ngram"}'])
    assert exit_info.value.code == 2
    assert ("argument --speculative-config: speculative_config.num_speculative_tokens must be "
            "an integer in [1, 16], got None") in capsys.readouterr().err


def test_engine_stats_and_offline_report_spec_decode() -> None:
    base = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
            "kv_peak_blocks": 5, "num_blocks": 64, "kv_waste_at_peak": 0.0}
    stats = engine_stats({**base, **_spec_stats(1, 2, 1, [1, 0])},
                         {**base, **_spec_stats(5, 10, 6, [4, 2])})
    assert stats["spec_decode"]["num_drafts"] == 4
    assert stats["spec_decode"]["mean_acceptance_length"] == 2.25
    assert engine_stats(base, base)["spec_decode"] is None
    lines = format_offline(offline_report(stats)).splitlines()
    assert ("aioengine: speculative decoding: mean acceptance length 2.25, accepted 5 / "
            "drafted 8 tokens (62.5%) in 4 drafts, per-position acceptance rate "
            "[0.750, 0.500]") in lines




def test_latency_reports_spec_decode(tmp_path) -> None:
    spec = spec_decode_delta({}, _spec_stats(10, 40, 15, [8, 4, 2, 1]))
    run = LatencyRun([0.1, 0.3, 0.3, 0.4], 1e9, spec_decode=spec)
    assert run.to_json()["spec_decode"] == spec
    assert "spec_decode" not in LatencyRun([0.1, 0.2], 1e9).to_json()
    ours = EngineLatency("aioengine", [run], 2, spec_decode=spec).summary(weight_bytes=10**8)
    assert ours["spec_decode"]["mean_acceptance_length"] == 2.5
    assert ours["runs"][0]["spec_decode"]["num_drafts"] == 10
    assert EngineLatency("aioengine", [run], 2).summary()["spec_decode"] is None  # off
    assert "spec_decode" not in EngineLatency("hf", [run], 2).summary()
    stat = {"median": 2.0, "best": 1.0}
    config = {"input_len": 4, "output_len": 4, "seed": 0, "repeats": 1, "warmup": 0,
              "dataset": "grounded",
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}
    report = {"environment": {"torch": "t", "transformers": "x", "torch_threads": 2,
                              "cpu_count": 2, "cuda": None}, "model": "m", "config": config,
              "workload": {"dataset": "grounded", "prompt_len_min": 321},
              "floor": {"bandwidth_gb_per_s": 1.0, "bandwidth_repeats": 5,
                        "bandwidth_buffer_bytes": 1 << 20, "weight_bytes": 10**6,
                        "floor_ms": 1.0},
              "results": {"aioengine": {**ours, "tpot_over_floor": stat}}, "skipped": {}}
    lines = format_latency(report).splitlines()
    assert lines[3].startswith("one request: 321-token prompt from the grounded dataset")
    assert ("aioengine speculative decoding (ngram, 4 tokens), timed runs: mean acceptance "
            "length 2.50, accepted 15 / drafted 40 tokens (37.5%) in 10 drafts, "
            "per-position acceptance rate [0.800, 0.400, 0.200, 0.100]") in lines
    save_json(str(tmp_path / "r.json"), report)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"]["aioengine"]["spec_decode"]["num_accepted_tokens"] == 15
    report["results"]["aioengine"]["spec_decode"] = None
    assert not any("speculative" in line for line in format_latency(report).splitlines())


def test_latency_run_maths_and_summary() -> None:
    run = LatencyRun([0.1, 0.3, 0.4, 0.7])
    assert (run.ttft_s, run.e2e_s) == (0.1, 0.7)
    assert run.tpot_s == pytest.approx(0.2) and run.itls_s == pytest.approx([0.2, 0.1, 0.3])
    assert run.to_json()["itl_median_ms"] == pytest.approx(200.0)
    runs = [LatencyRun(run.token_times_s, 1e9), LatencyRun([0.2, 0.3, 0.4, 0.5], 2e9)]
    summary = EngineLatency("aioengine", runs, 2).summary()
    assert summary["tpot_ms"] == pytest.approx({"median": 150.0, "best": 100.0})
    assert summary["ttft_ms"] == pytest.approx({"median": 150.0, "best": 100.0})
    assert summary["num_runs"] == 2 and len(summary["runs"]) == 2
    assert "tpot_over_floor" not in summary
    # 1e8 weight bytes: floors of 100 ms (1 GB/s) and 50 ms (2 GB/s) for the two runs.
    summary = EngineLatency("aioengine", runs, 2).summary(weight_bytes=10**8)
    assert [r["tpot_over_floor"] for r in summary["runs"]] == pytest.approx([2.0, 2.0])
    assert summary["tpot_over_floor"] == pytest.approx({"median": 2.0, "best": 2.0})


def test_latency_command_line_and_bandwidth() -> None:
    args = build_parser().parse_args(["latency"])
    assert (args.input_len, args.output_len, args.repeats, args.warmup, args.seed) == \
        (256, 128, 3, 1, 0)
    assert args.engines == ["aioengine", "hf"] and args.bandwidth_mib == 1024
    assert args.dataset == "random"
    assert build_parser().parse_args(["latency", "--dataset", "grounded"]).dataset == "grounded"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["latency", "--dataset", "shared-prefix"])
    assert parse_latency_engines("hf, aioengine") == ["hf", "aioengine"]
    for bad in ("", "hf-cb", "hf,hf", "aioengine-no-prefix-caching"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_latency_engines(bad)
    assert measure_read_bandwidth(1 << 20, repeats=2) > 0


def test_bandwidth_probe_keeps_one_child_and_each_run_takes_the_higher() -> None:
    with BandwidthProbe(1 << 20, repeats=2, settle_s=0) as probe:
        with pytest.raises(RuntimeError):
            probe.after_run()
        probe.before_run()
        before, child = probe._last, probe._proc
        first = probe.after_run()  # measures once more: the next run's "before"
        assert first == max(before, probe._last) > 0
        probe.before_run()  # reuses the measurement after the previous run
        between = probe._last
        assert probe.after_run() == max(between, probe._last)
        assert probe._proc is child  # one child, and one buffer, for every measurement
    assert probe._proc is None and child.returncode == 0
