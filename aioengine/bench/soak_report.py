"""The soak test's report (aioengine/bench/soak.py): counts by kind and outcome, how each
slow-client and context-length case ended, the short streams' TTFT with and without long
prompts in flight, the server's memory and fds over time, the state after the traffic, and
the verdict."""
from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

import aiohttp
import orjson

from aioengine.bench.soak_traffic import BAD_OUTCOMES, OUTCOMES, Outcome

_BRIEF_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")


def _slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return None
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (v - mv) for t, v in points) / var if var else None


def _trend(samples: list[dict], key: str, warmup_s: float) -> dict[str, Any] | None:
    """start (first sample after the warm-up), end, max, and the slopes per minute after
    the warm-up and over the last half of that (a plateau and a leak look alike early)."""
    points = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not points:
        return None
    after = [p for p in points if p[0] >= warmup_s] or points[-1:]
    return {"start": after[0][1], "end": points[-1][1], "max": max(v for _, v in points),
            "slope_per_min": _slope_per_min(after),
            "slope_last_half_per_min": _slope_per_min(after[len(after) // 2:])}


def _counts(results: list[Outcome]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        row = counts.setdefault(r.kind, dict.fromkeys(OUTCOMES, 0))
        row[r.outcome] += 1
    return counts


def _stats(values: list[float]) -> dict[str, Any]:
    v = sorted(values)
    if not v:
        return {"n": 0, "min": None, "p50": None, "p95": None, "max": None}
    return {"n": len(v), "min": v[0], "p50": v[len(v) // 2],
            "p95": v[min(len(v) - 1, int(0.95 * len(v)))], "max": v[-1]}


def _cases(results: list[Outcome]) -> dict[str, dict[str, dict[str, Any]]]:
    """For the kinds whose outcomes carry a label (slow clients, context-length prompts):
    by kind and label, how many and how long they took (for a stalled connection: until
    the server closed it)."""
    by: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if r.label:
            by.setdefault(r.kind, {}).setdefault(r.label, []).append(r.latency_s)
    return {kind: {label: _stats(v) for label, v in sorted(labels.items())}
            for kind, labels in sorted(by.items())}


SHORT_STREAMS = ("stream", "cancel")


def _ttft(results: list[Outcome]) -> dict[str, Any]:
    """The short streams' TTFT: alone (the "alone" kind, on the idle server before the
    traffic), and in the traffic by what was in flight between their start and their first
    token: no long prompt; a long prompt (a long burst or a near_context prompt); a
    near_context prompt (on the soak's own server, whose context is its KV cache, that
    prompt also leaves the others few KV blocks); a slow reader."""
    short = [r for r in results if r.kind in SHORT_STREAMS and r.ttft_s is not None]
    long = [r for r in short if {"long", "near_context"} & set(r.overlaps)]
    groups = {"without_long": [r.ttft_s for r in short
                               if not {"long", "near_context"} & set(r.overlaps)],
              "during_long": [r.ttft_s for r in long],
              "during_near_context": [r.ttft_s for r in long if "near_context" in r.overlaps],
              "during_slow_reader": [r.ttft_s for r in short if "slow_reader" in r.overlaps]}
    groups["alone"] = [r.ttft_s for r in results if r.kind == "alone" and r.ttft_s is not None]
    ttft: dict[str, Any] = {k: _stats(v) for k, v in groups.items()}
    during = ttft["during_long"]["p50"]
    for base in ("alone", "without_long"):
        p50 = ttft[base]["p50"]
        ttft[f"p50_ratio_during_long_to_{base}"] = (round(during / p50, 2) if p50 and during
                                                    else None)
    return ttft


def _latencies(results: list[Outcome]) -> dict[str, dict[str, float]]:
    by_kind: dict[str, list[float]] = {}
    for r in results:
        if r.outcome == "ok":
            by_kind.setdefault(r.kind, []).append(r.latency_s)
    return {k: {"p50": v[len(v) // 2], "p95": v[min(len(v) - 1, int(0.95 * len(v)))],
                "max": v[-1]} for k, v in ((k, sorted(v)) for k, v in by_kind.items())}


def environment() -> dict[str, Any]:
    from aioengine import cpu_info

    flags = cpu_info.cpu_flags()
    here = os.path.dirname(os.path.abspath(__file__))
    return {"cpu_model": cpu_info.cpu_model(), "cpu_count": os.cpu_count(),
            "cpu_flags": [f for f in _BRIEF_FLAGS if f in flags]
            + sorted(f for f in flags if f.startswith("amx")),
            "python": platform.python_version(), "platform": platform.platform(),
            "aiohttp": aiohttp.__version__, **_git(here)}


def _git(cwd: str) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": git("rev-parse", "HEAD"),
            "git_dirty": None if status is None else bool(status)}


def _allowed_5xx(expect: str, results: list[Outcome]) -> int:
    """How many of the 5xx --expect-5xx excuses: a count, or those of the named kinds."""
    fives = [r for r in results if r.outcome == "5xx"]
    if expect.strip().isdigit():
        return min(len(fives), int(expect))
    kinds = {k.strip() for k in expect.split(",") if k.strip()}
    return sum(1 for r in fives if "all" in kinds or r.kind in kinds)


def _verdict(report: dict[str, Any], results: list[Outcome], expect: str) -> list[str]:
    reasons = []
    unexcused = report["num_5xx"] - _allowed_5xx(expect, results)
    if unexcused:
        reasons.append(f"{unexcused} unexpected 5xx")
    bad = sum(1 for r in results if r.outcome in BAD_OUTCOMES and r.outcome != "5xx")
    if bad:
        reasons.append(f"{bad} unexpected outcomes")
    if not results:
        reasons.append("no requests finished")
    if report["server_gone"]:
        reasons.append("the server process went away during the traffic")
    if not report["greedy_unchanged"]:
        reasons.append("a greedy completion differs after the traffic from before it")
    idle = report["after_idle"]
    if not idle["idle"]:
        reasons.append(f"not idle after {idle['waited_s']} s: KV usage {idle['kv_usage']}, "
                       f"{idle['running']} running, {idle['waiting']} waiting")
    srv = report["server_exit"]
    if srv and (srv["returncode"] != 0 or srv["num_error_lines"]):
        reasons.append(f"server exit {srv['returncode']}, {srv['num_error_lines']} error "
                       "lines in its log")
    return reasons


def build_report(config: dict[str, Any], run: dict[str, Any], url: str,
                 server_exit: dict[str, Any] | None) -> dict[str, Any]:
    """`config`: the SoakConfig's fields plus kv_blocks and long_prompt_tokens as used;
    `run`: what soak.run_soak returned."""
    results: list[Outcome] = run["results"]
    warmup_s = min(0.1 * config["duration_s"], 60.0)
    idle, samples, blocks = run["idle"], run["samples"], config["kv_blocks"]
    idle["kv_blocks_in_use"] = (round(idle["kv_usage"] * blocks)
                                if blocks and idle["kv_usage"] is not None else None)
    report: dict[str, Any] = {
        "mode": "soak", "url": url, "model": run["model"], "environment": environment(),
        "config": config, "traffic_s": run["traffic_s"], "warmup_s": warmup_s,
        "num_requests": len(results), "counts": _counts(results),
        "num_5xx": sum(1 for r in results if r.outcome == "5xx"),
        "latency_s": _latencies(results), "cases": _cases(results),
        "ttft_s": _ttft(results),
        "rss_mib": _mib(_trend(samples, "rss_kib", warmup_s)),
        "fds": _trend(samples, "fds", warmup_s),
        "threads": _trend(samples, "threads", warmup_s),
        "cpu_cores": _cpu_cores(samples),
        "preemptions": run["preemptions"], "server_gone": run["server_gone"],
        "greedy_unchanged": run["greedy_unchanged"],
        "max_kv_usage": max((s.get("kv_usage") or 0 for s in samples), default=None),
        "max_waiting": max((s.get("waiting") or 0 for s in samples), default=None),
        "after_idle": idle, "server_exit": server_exit,
        "failures": [r.to_json() for r in results if r.outcome in BAD_OUTCOMES][:100],
        "samples": samples, "requests": [r.to_json() for r in results]}
    reasons = _verdict(report, results, config["expect_5xx"])
    report["verdict"] = {"pass": not reasons, "reasons": reasons}
    return report


def save_json(path: str, report: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")


def _cpu_cores(samples: list[dict]) -> float | None:
    """Mean cores the server used between the first and the last sample."""
    points = [(s["t"], s["cpu_s"]) for s in samples if s.get("cpu_s") is not None]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _mib(trend: dict[str, Any] | None) -> dict[str, Any] | None:
    if trend is None:
        return None
    return {k: None if v is None else round(v / 1024, 2) for k, v in trend.items()}


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _trend_line(name: str, trend: dict[str, Any] | None, unit: str) -> str:
    if trend is None:
        return f"{name}: not sampled (no --server-pid)"
    return (f"{name}: start {_fmt(trend['start'])}{unit}, end {_fmt(trend['end'])}{unit}, "
            f"max {_fmt(trend['max'])}{unit}; slope {_fmt(trend['slope_per_min'], 2)}{unit}/min "
            f"after the warm-up, {_fmt(trend['slope_last_half_per_min'], 2)}{unit}/min over "
            "its last half")


def format_report(report: dict[str, Any]) -> str:
    env, cfg, idle = report["environment"], report["config"], report["after_idle"]
    commit = (env["git_commit"] or "?")[:12] + (" (dirty)" if env["git_dirty"] else "")
    lines = [f"soak: {report['traffic_s']} s of traffic against {report['url']} "
             f"({report['model']}), concurrency {cfg['concurrency']}, seed {cfg['seed']}, "
             f"{report['num_requests']} requests; warm-up {report['warmup_s']:g} s",
             f"CPU: {env['cpu_model']} ({' '.join(env['cpu_flags']) or 'no listed flags'}); "
             f"commit {commit}",
             f"{'kind':<13}" + "".join(f"{o:>15}" for o in OUTCOMES) + f"{'ok p50 s':>10}"
             + f"{'ok p95 s':>10}"]
    total = dict.fromkeys(OUTCOMES, 0)
    for kind, row in sorted(report["counts"].items()):
        lat = report["latency_s"].get(kind, {})
        lines.append(f"{kind:<13}" + "".join(f"{row[o]:>15}" for o in OUTCOMES)
                     + f"{_fmt(lat.get('p50'), 2):>10}{_fmt(lat.get('p95'), 2):>10}")
        total = {o: total[o] + row[o] for o in OUTCOMES}
    lines.append(f"{'all':<13}" + "".join(f"{total[o]:>15}" for o in OUTCOMES))
    lines += [*_case_lines(report), *_ttft_lines(report["ttft_s"]),
              f"5xx: {report['num_5xx']}",
              _trend_line("server RSS", report["rss_mib"], " MiB"),
              _trend_line("server fds", report["fds"], ""),
              _trend_line("server threads", report["threads"], ""),
              f"server CPU: {_fmt(report['cpu_cores'], 2)} cores on average during the "
              "traffic",
              f"preemptions: {_fmt(report['preemptions'], 0)}; long prompts of "
              f"{cfg['long_prompt_tokens']} tokens, {cfg['long_burst']} at once; max KV "
              f"usage {_fmt(report['max_kv_usage'], 3)}, max waiting "
              f"{_fmt(report['max_waiting'], 0)}",
              f"after the traffic ({idle['waited_s']} s to idle): running "
              f"{_fmt(idle['running'], 0)}, waiting {_fmt(idle['waiting'], 0)}, KV usage "
              f"{_fmt(idle['kv_usage'], 4)}, blocks in use {_fmt(idle['kv_blocks_in_use'])}"
              + (f" of {cfg['kv_blocks']}" if cfg["kv_blocks"] else "")]
    if report["server_exit"]:
        srv = report["server_exit"]
        lines.append(f"server exit {srv['returncode']}, {srv['num_error_lines']} error lines "
                     "in its log" + "".join(f"\n  {line}" for line in srv["error_lines"][:5]))
    for f in report["failures"][:10]:
        lines.append(f"  {f['kind']} {f['outcome']} {f['status']} at {f['started_s']} s: "
                     f"{f['detail'][:300]}\n    request: {f['request'][:200]}")
    verdict = report["verdict"]
    lines.append("PASS" if verdict["pass"] else "FAIL: " + "; ".join(verdict["reasons"]))
    return "\n".join(lines)


def _case_lines(report: dict[str, Any]) -> list[str]:
    if not report["cases"]:
        return []
    cfg = report["config"]
    about = {"slow_head": f"--keepalive-timeout {cfg['keepalive_timeout_s']:g}",
             "slow_body": f"--body-read-timeout {cfg['body_read_timeout_s']:g}",
             "near_context": f"prompts of {cfg['near_context_tokens']} tokens",
             "over_context": f"the context is {cfg['max_model_len']} tokens"}
    lines = ["slow clients and context-length prompts: how each ended, how many (seconds "
             "from the start to the close, the answer or the disconnect, min-max)"]
    for kind, labels in report["cases"].items():
        parts = [f"{label} {st['n']} ({_fmt(st['min'], 1)}-{_fmt(st['max'], 1)} s)"
                 for label, st in labels.items()]
        note = f"  [{about[kind]}]" if kind in about else ""
        lines.append(f"  {kind:<13}{', '.join(parts)}{note}")
    return lines


def _ttft_lines(ttft: dict[str, Any]) -> list[str]:
    def stat(name: str, what: str) -> str:
        st = ttft[name]
        return (f"{what}: p50 {_fmt(st['p50'], 2)} s, p95 {_fmt(st['p95'], 2)} s, max "
                f"{_fmt(st['max'], 2)} s (n={st['n']})")
    if not any(ttft[k]["n"] for k in ("alone", "without_long", "during_long")):
        return []
    ratios = ", ".join(f"{_fmt(ttft[f'p50_ratio_during_long_to_{base}'], 2)}x {what}"
                       for base, what in (("alone", "alone"),
                                          ("without_long", "without long prompts")))
    return ["short streams' TTFT:",
            f"  {stat('alone', 'alone (idle server, before the traffic)')}",
            f"  {stat('without_long', 'in the traffic, no long prompt in flight')}",
            f"  {stat('during_long', 'in the traffic, during long prompts')}; p50 {ratios}",
            f"  {stat('during_near_context', 'of which during near_context prompts')}",
            f"  {stat('during_slow_reader', 'in the traffic, during slow readers')}"]
