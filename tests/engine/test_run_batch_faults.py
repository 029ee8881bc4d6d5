"""run-batch in process on a tiny model, with the engine's real failure paths (faults.py):
a failed forward is that line's 500 record and the others go on; an engine that dies
stops the run without records for the lines it took down, and a resumed run on a fresh
engine completes the file with every custom_id once. KV blocks all released."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import orjson
import pytest

from aioengine import AsyncEngine
from aioengine.errors import EngineDeadError
from aioengine.server.api_server import build_serving_context
from aioengine.server.batch import run_batch_file
from aioengine.server.server_config import ServerConfig

N = 24


async def start_engine(model_dir: Path) -> AsyncEngine:
    return await AsyncEngine.create(str(model_dir), max_model_len=256, dtype="float32",
                                    max_num_batched_tokens=64, max_num_seqs=4)


def write_requests(path: Path) -> None:
    rng = random.Random(1)
    lines = [orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": [rng.randrange(100, 4000) for _ in range(12)],
                                    "max_tokens": 24, "ignore_eos": True, "temperature": 0}})
             for i in range(N)]
    path.write_bytes(b"\n".join(lines) + b"\n")


def records(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def run(engine: AsyncEngine, inp: Path, out: Path, **kw) -> object:
    ctx = await build_serving_context(engine, ["tiny"], ServerConfig())
    try:
        return await run_batch_file(ctx, str(inp), str(out), progress=False, **kw)
    finally:
        ctx.work.shutdown()


async def test_a_failed_forward_is_one_500_record_and_the_rest_run(tiny_llama_dir: Path,
                                                                   tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_requests(inp)
    engine = await start_engine(tiny_llama_dir)
    try:
        engine.inject_fault("forward", 1)
        summary = await run(engine, inp, out, max_concurrent=2)
        stats = engine.stats()
        assert engine.is_running and stats["num_running"] == stats["num_waiting"] == 0
        assert stats["kv_cache_usage"] == 0
    finally:
        await engine.shutdown()
    recs = records(out)
    assert sorted(r["custom_id"] for r in recs) == sorted(f"r{i}" for i in range(N))
    failed = [r for r in recs if r["response"]["status_code"] != 200]
    assert [r["response"]["status_code"] for r in failed] == [500] * len(failed)
    assert 1 <= len(failed) <= 2  # the step's requests (at most 2 in flight)
    assert summary.ok == N - len(failed) and summary.failed == len(failed)


async def test_a_dead_engine_stops_the_run_and_resume_completes_it(tiny_llama_dir: Path,
                                                                   tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_requests(inp)
    engine = await start_engine(tiny_llama_dir)
    try:
        task = asyncio.create_task(run(engine, inp, out, max_concurrent=4))
        while not (out.exists() and out.read_bytes().count(b"\n") >= 4):
            assert not task.done()
            await asyncio.sleep(0.005)
        engine.inject_fault("loop")
        with pytest.raises(EngineDeadError):
            await task
    finally:
        await engine.shutdown()
    kept = records(out)
    assert 4 <= len(kept) < N
    assert all(r["response"]["status_code"] == 200 for r in kept)  # none for the lost lines
    engine = await start_engine(tiny_llama_dir)
    try:
        summary = await run(engine, inp, out)
    finally:
        await engine.shutdown()
    assert summary.skipped == len(kept) and summary.ok == N - len(kept)
    recs = records(out)
    assert sorted(r["custom_id"] for r in recs) == sorted(f"r{i}" for i in range(N))
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 24 for r in recs)
