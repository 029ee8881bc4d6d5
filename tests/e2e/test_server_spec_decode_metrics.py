"""Speculative decoding through a real `aioengine serve --speculative-config` process:
vLLM's spec_decode_* counters on /metrics and the periodic "SpecDecoding" log line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_process import MODEL, ServerProcess, openai_client, serving

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
# The answer continues the pattern, so the n-gram proposer finds its drafts in the prompt.
PROMPT = "one two three four five, " * 12 + "one two three"
PER_POS = "aioengine:spec_decode_num_accepted_tokens_per_pos_total"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--speculative-config", json.dumps(SPEC),
                       env={"AIOENGINE_LOG_STATS_INTERVAL": "0.5"})


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def test_spec_decode_counters_are_consistent(server: ServerProcess,
                                             client: openai.OpenAI) -> None:
    before = server.wait_idle()
    assert before["aioengine:spec_decode_num_drafts_total"] == 0
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = server.wait_idle()
    assert out.usage.completion_tokens == 32
    drafts = after["aioengine:spec_decode_num_drafts_total"]
    drafted = after["aioengine:spec_decode_num_draft_tokens_total"]
    accepted = after["aioengine:spec_decode_num_accepted_tokens_total"]
    per_pos = [after[f'{PER_POS}{{method="ngram",model_name="{MODEL}",position="{pos}"}}']
               for pos in range(K)]
    assert 0 < drafts <= drafted <= K * drafts
    assert 0 < accepted <= drafted
    assert sum(per_pos) == accepted == after[PER_POS]  # the helper's sum over positions
    # A draft token is accepted only after every one before it: fewer at each later position.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= drafts
    # Each verification yields its accepted drafts plus one sampled token.
    assert drafts + accepted <= after["aioengine:generation_tokens_total"] - before.get(
        "aioengine:generation_tokens_total", 0.0)


def test_periodic_log_line(server: ServerProcess) -> None:
    deadline = time.monotonic() + 10
    while not any("SpecDecoding: mean acceptance length" in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log)
        time.sleep(0.1)
    line = next(line for line in server.log if "SpecDecoding:" in line)
    assert "accepted" in line and "drafted" in line and "per-position acceptance rate [" in line


@pytest.mark.parametrize("spec, message", [
    ('{"method": "ngram", ', "speculative_config is not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens must be an integer in [1, 16], got 0"),
])
def test_bad_speculative_config_fails_at_start_up(spec: str, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "aioengine.cli", "serve", "--port", "0",
                           "--speculative-config", spec],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


DASHBOARD = Path(__file__).resolve().parents[2] / "scripts/grafana/dashboards/aioengine.json"


def _dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if v.get("definition")]
    return exprs


def test_every_series_the_dashboard_queries_is_on_metrics(server: ServerProcess,
                                                          client: openai.OpenAI) -> None:
    """scripts/grafana's dashboard against this server's /metrics (speculative decoding on,
    so its series exist too): every metric a panel queries is there, with every label the
    panel groups by."""
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    server.wait_idle()
    status, body = server.request("GET", "/metrics")
    assert status == 200
    lines = [line for line in body.decode().splitlines() if line and not line.startswith("#")]
    exprs = _dashboard_queries()
    assert len(exprs) >= 16
    for expr in exprs:
        names = set(re.findall(r"aioengine:[a-zA-Z0-9_:]+", expr))
        assert names, expr
        grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr)
                   for label in group.split(",")} - {"le"}
        grouped |= set(re.findall(r"label_values\([^,]+, (\w+)\)", expr))
        queried = []
        for name in names:
            series = [line for line in lines if line.startswith((name + "{", name + " "))]
            assert series, (name, expr)
            queried += series
        for label in grouped:  # on the series of one of the expression's metrics
            assert any(f'{label}="' in line for line in queried), (label, expr)
