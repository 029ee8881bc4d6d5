"""`aioengine serve --ray-replicas 2` on a real local Ray cluster: the bundled model in two
engine replicas of one CPU thread each, behind Ray's HTTP proxy, driven with the real
`openai` client. The same routes, errors, streaming and structured output as one server;
prefix-cache affinity; LoRA adapters through Ray Serve's model multiplexing (one per
replica, so a third evicts one); every replica's engine metrics in Ray's Prometheus export;
a replica whose engine loop dies is routed around and replaced. One cluster for the whole
module (Ray's start and two model loads take most of its time)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import psutil
import pytest
from ray_clients import (assert_failed_cleanly, assert_served_elsewhere_then_replaced, complete,
                         replica_of, stream_long_answers)
from server_process import _READY, MODEL, ServerProcess, openai_client

from tests.lora_adapters import make_peft_adapter

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

GRACE_S = 4  # --ray-graceful-shutdown-timeout: how long a stopping replica's streams run on
# ~600 tokens shared by the affinity prompts (the bundled tokenizer: ~4.3 bytes a token).
SHARED_PREFIX = " ".join(f"Fact {i}: the number {i} times seven is {i * 7}." for i in range(40))
# Random PEFT adapters for the bundled model (make_peft_adapter arguments); --lora-modules
# with --ray-max-adapters-per-replica 1.
ADAPTERS = {"alpha": dict(r=8, target_modules=["q_proj", "v_proj"], seed=1),
            "beta": dict(r=4, target_modules=["o_proj", "down_proj"], seed=2, scale=0.1),
            "gamma": dict(r=8, target_modules=["q_proj", "k_proj"], seed=3)}
ADAPTER_PROMPT = "The three largest cities of Italy are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from aioengine.bench.hf_export import export_hf

    root, model_dir = tmp_path_factory.mktemp("ray_lora"), export_hf()
    return {name: make_peft_adapter(model_dir, root / name, **kw)
            for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path], metrics_port: int) -> Iterator[ServerProcess]:
    """The CLI in a subprocess, stopped by the last test (or here, if it did not run)."""
    cmd = [sys.executable, "-m", "aioengine.cli", "serve", "--ray-replicas", "2",
           "--ray-replica-cpus", "1", "--port", str(free_port()), "--num-kv-blocks", "512",
           "--ray-graceful-shutdown-timeout", str(GRACE_S),
           "--enable-lora", "--max-lora-rank", "8",
           "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()),
           "--ray-max-adapters-per-replica", "1",
           "--ray-metrics-export-port", str(metrics_port)]
    # A Ray of its own (not $RAY_ADDRESS's); the fault route for the last test; replicas
    # report metrics every second (Ray's default: 10).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(AIOENGINE_FAULT_INJECTION="1", RAY_USAGE_STATS_ENABLED="0",
               RAY_metrics_report_interval_ms="1000")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    log: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def drain() -> None:
        for line in proc.stderr:
            log.append(line)
            match = _READY.search(line)
            if match and not url:
                url.append(match.group(2))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(300) or not url:
        proc.kill()
        raise RuntimeError("Ray Serve did not start:\n" + "".join(log))
    srv = ServerProcess(proc, url[0], MODEL, log)
    yield srv
    stop_without_leaks(srv)


def stop_without_leaks(srv: ServerProcess) -> None:
    """SIGTERM (once); exit 0 and every process it started (Ray's GCS, raylet, workers,
    replicas) gone."""
    if srv.proc.poll() is not None:
        return
    started = psutil.Process(srv.proc.pid).children(recursive=True)
    assert srv.stop(timeout=120) == 0, "".join(srv.log[-50:])
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.pid for p in alive]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def test_chat_and_completions(client: openai.OpenAI) -> None:
    out, _ = complete(client, "The capital of France is", max_tokens=8)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL, *ADAPTERS]


def test_streaming_matches_the_full_answer(client: openai.OpenAI) -> None:
    # Long enough to be routed by prefix (both calls on one replica), and sent once before,
    # so that both read the prompt from the prefix cache: in bf16 a prompt computed afresh
    # and one read from the cache can give different greedy tokens.
    messages = [{"role": "user", "content": "Name three colors. " + SHARED_PREFIX[:400]}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    once = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                     temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                              max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == once.choices[0].text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert streamed[-1].usage.completion_tokens == 12
    # Streamed as produced, not as one final blob. Not one chunk per token: when the proxy
    # reads behind the engine, the replica merges the pending deltas of a request into one.
    assert len([c for c in streamed if c.choices]) >= 2


def test_a_400_stays_a_400_with_the_openai_error_body(client: openai.OpenAI,
                                                       server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == \
        "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    status, body = server.request("POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = server.request("POST", "/v1/completions", b'{"prompt": "' + b"x" * (9 << 20))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    status, body = server.request("GET", "/no/such/route")
    assert status == 404 and "error" in json.loads(body)


def test_structured_output_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
        "required": ["name", "age"]}
    out = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "cat", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_shared_prefix_requests_land_on_one_replica_and_hit_its_cache(
        client: openai.OpenAI) -> None:
    answers = [complete(client, f"{SHARED_PREFIX} Question {i}: what is fact {i}?")
               for i in range(4)]
    assert answers[0][0].usage.prompt_tokens > 512
    assert len({replica for _, replica in answers}) == 1
    for out, _ in answers[1:]:
        assert out.usage.prompt_tokens_details.cached_tokens > 0


def test_unrelated_prompts_spread_over_both_replicas(client: openai.OpenAI) -> None:
    prompts = [f"Unrelated request {i}: {'tell me something ' * (5 + i)}" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replicas = {replica for _, replica in
                    pool.map(lambda p: complete(client, p, max_tokens=16), prompts)}
    assert len(replicas) == 2


def adapter_answer(client: openai.OpenAI, adapter: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model=adapter, prompt=ADAPTER_PROMPT,
                                                      max_tokens=8, temperature=0)
    out = raw.parse()
    assert out.model == adapter and out.choices[0].finish_reason == "length"
    return out.choices[0].text, replica_of(raw)


def test_adapters_route_through_model_multiplexing(client: openai.OpenAI) -> None:
    """One adapter per replica: alpha's requests stay on the replica that loaded it, beta
    goes to the other; gamma then evicts one of them there, and the evicted one is loaded
    again where it is asked for. Greedy answers never change (the prompt is shorter than a
    block, so nothing comes from the prefix cache)."""
    base = complete(client, ADAPTER_PROMPT, max_tokens=8)[0].choices[0].text
    first = {}
    for name in ("alpha", "beta"):
        first[name] = adapter_answer(client, name)
        time.sleep(2.5)  # Ray's routers hear which replica holds which adapter
    texts = {name: text for name, (text, _) in first.items()}
    assert len({base, *texts.values()}) == 3  # each adapter changes the answer
    assert first["alpha"][1] != first["beta"][1]  # beta went to the replica without one
    for name in ("alpha", "beta", "alpha", "beta"):
        text, replica = adapter_answer(client, name)
        assert (text, replica) == first[name]
    texts["gamma"] = adapter_answer(client, "gamma")[0]
    assert texts["gamma"] not in (base, texts["alpha"], texts["beta"])
    # Concurrent requests for all three on two replicas that hold one each: loads and
    # evictions under way while others are answered; none fails (an adapter is unloaded
    # only after its last request ended) and each gets its adapter's own greedy answer
    # (batched with the others' or not: the engine's LoRA batches are exact).
    names = [*ADAPTERS] * 3
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda name: adapter_answer(client, name)[0], names))
    assert answers == [texts[name] for name in names]
    for name in ADAPTERS:  # and alone again, each still gives its first answer
        assert adapter_answer(client, name)[0] == texts[name]


def test_responses_follow_ups_reach_the_replica_that_stores_them(client: openai.OpenAI) -> None:
    """Each replica stores its own responses; their ids name it, so retrieving one or
    continuing it (`previous_response_id`) never lands on the other replica (a 404)."""
    for i in range(4):
        first = client.responses.create(model=MODEL, input=f"Say hello {i}.",
                                        max_output_tokens=4, temperature=0)
        assert first.id.startswith("resp_")
        assert client.responses.retrieve(first.id).id == first.id
        follow = client.responses.create(model=MODEL, input="And again.", temperature=0,
                                         max_output_tokens=4, previous_response_id=first.id)
        assert follow.previous_response_id == first.id
        assert client.responses.retrieve(follow.id).id == follow.id


def test_every_replicas_metrics_in_rays_prometheus_export(client: openai.OpenAI,
                                                          metrics_port: int) -> None:
    """The engine metrics of both replicas, each series tagged with its replica, on the
    node's Ray metrics export port."""
    with ThreadPoolExecutor(8) as pool:  # at once, so that both replicas get some
        replicas = {replica for _, replica in pool.map(
            lambda i: complete(client, f"Metrics probe {i} {'x ' * i}", max_tokens=16),
            range(8))}
    assert len(replicas) == 2
    series = re.compile(r'^ray_aioengine[:_]generation_tokens_total\{([^}]*)\} (\S+)$', re.M)
    deadline = time.monotonic() + 60
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as r:
            text = r.read().decode()
        seen = {}
        for labels, value in series.findall(text):
            replica = re.search(r'replica="([^"]+)"', labels)
            if replica and 'model_name="' + MODEL + '"' in labels:
                seen[replica.group(1)] = float(value)
        if replicas <= set(seen) and all(seen[r] > 0 for r in replicas):
            break
        time.sleep(1.0)
    assert replicas <= set(seen) and all(seen[r] > 0 for r in replicas), (replicas, seen)
    for name in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_bucket", "request_success_total"):
        assert re.search(rf"^ray_aioengine[:_]{name}\{{", text, re.M), name


def test_a_replica_whose_engine_loop_dies_is_routed_around_and_replaced(
        client: openai.OpenAI, server: ServerProcess) -> None:
    prefix = SHARED_PREFIX.replace("Fact", "Loop fact")
    _, doomed = complete(client, prefix + " Warm-up.")
    streams = stream_long_answers(client, prefix, doomed)
    # The fault route does not read `prompt`: it only routes this call to `doomed`.
    status, body = server.request("POST", "/debug/faults", {"kind": "loop", "prompt": prefix})
    assert status == 200, body
    assert_failed_cleanly(streams)
    assert_served_elsewhere_then_replaced(client, doomed, prefix)


def test_a_killed_replica_actor_is_routed_around_and_restarted(
        client: openai.OpenAI) -> None:
    import ray

    prefix = SHARED_PREFIX.replace("Fact", "Kill fact")
    _, doomed = complete(client, prefix + " Warm-up.")
    ray.init(address="auto", log_to_driver=False)  # the cluster the CLI started
    try:
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if "EngineReplica" in a["name"] and a["name"].endswith(doomed))
        streams = stream_long_answers(client, prefix, doomed)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        assert_failed_cleanly(streams)
        assert_served_elsewhere_then_replaced(client, doomed, prefix)
    finally:
        ray.shutdown()


def test_sigterm_lets_short_streams_finish_cuts_long_ones_and_leaves_no_process(
        client: openai.OpenAI, server: ServerProcess) -> None:
    """Last: stops the module's server. Ray drains each replica for GRACE_S seconds and then
    kills it: a short stream under way ends normally, one that would run far longer ends
    with an OpenAI error event (the ingress's word for the replica gone), soon after."""
    def first_chunk_then_rest(max_tokens: int) -> tuple[list, object]:
        stream = client.completions.create(model=MODEL, prompt="Once upon a time",
                                           max_tokens=max_tokens, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return [next(iter(stream))], stream

    def rest_or_error(stream) -> list | openai.APIError:
        try:
            return list(stream)
        except openai.APIError as e:
            return e

    short, short_rest = first_chunk_then_rest(48)
    _, long_rest = first_chunk_then_rest(4000)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    with ThreadPoolExecutor(2) as pool:
        short_end, long_end = pool.map(rest_or_error, (short_rest, long_rest))
    assert not isinstance(short_end, Exception), short_end
    short += short_end
    # "length": all 48 tokens came; streamed in several chunks (drafts kept in one step,
    # speculation being on by default, arrive together, so not one chunk a token).
    assert short[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in short if c.choices and c.choices[0].text) >= 4
    assert isinstance(long_end, openai.APIError) and "replica failed" in str(long_end)
    assert time.monotonic() - started < GRACE_S + 30
    stop_without_leaks(server)

