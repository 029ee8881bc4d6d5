"""`serve` mode: drive any OpenAI-compatible server with streaming requests and time them
(`--endpoint messages`: its Anthropic Messages API).

Arrivals: every request at once (bounded only by `--max-concurrency`), or at
`--request-rate` R requests/s with gamma-distributed gaps of mean 1/R; burstiness k is
the gamma shape (k = 1: Poisson arrivals; k < 1: burstier; k > 1: more regular, the
gaps' coefficient of variation is 1/sqrt(k)).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson

from aioengine.bench.common import add_workload_args, emit, run_config
from aioengine.bench.datasets import BenchRequest, Workload, build_workload, with_text
from aioengine.bench.metrics import RequestResult, parse_slo, summarize

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
             "messages": "/v1/messages"}  # messages: Anthropic's API, its SSE events


@dataclass(frozen=True)
class ServeConfig:
    base_url: str  # http://host:port, with or without a trailing /v1
    endpoint: str = "completions"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    max_concurrency: int | None = None  # None: unbounded
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0
    seed: int = 0
    temperature: float = 0.0
    timeout_s: float = 600.0
    progress: bool = True

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    @property
    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
            if self.endpoint == "messages":
                h["x-api-key"] = self.api_key
        if self.endpoint == "messages":
            h["anthropic-version"] = "2023-06-01"
        return h


def arrival_intervals(num_requests: int, request_rate: float, burstiness: float,
                      seed: int) -> list[float]:
    """Gaps between consecutive arrivals, seeded: Gamma(shape=k, scale=1/(R*k)) has mean
    1/R for every k. An infinite rate gives all-zero gaps."""
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num_requests).tolist()


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    seed: int) -> list[float]:
    """When each request is due, from the start: the first at 0, then cumulative gaps."""
    gaps = arrival_intervals(num_requests, request_rate, burstiness, seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        offsets.append(t)
        if i + 1 < num_requests:
            t += gaps[i + 1]
    return offsets


def build_payload(req: BenchRequest, config: ServeConfig, model: str,
                  max_tokens: int | None = None) -> dict[str, Any]:
    """The request body; `ignore_eos` + `max_tokens` make the output length exact."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens or req.output_len,
        "temperature": config.temperature, "ignore_eos": True, "stream": True}
    if config.endpoint != "messages":  # Anthropic's stream always reports usage
        body["stream_options"] = {"include_usage": True}
    if config.endpoint in ("chat", "messages"):
        if req.prompt_text is None:
            raise ValueError(f"the {config.endpoint} endpoint needs text prompts "
                             "(see datasets.with_text)")
        body["messages"] = [{"role": "user", "content": req.prompt_text}]
    else:
        # Text as written (the text dataset), else the exact token ids.
        body["prompt"] = req.prompt_text if req.prompt_text is not None else req.prompt_token_ids
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    if endpoint == "messages":
        delta = chunk.get("delta") if chunk.get("type") == "content_block_delta" else None
        return (delta or {}).get("text") or ""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _chunk_usage(chunk: dict[str, Any], endpoint: str) -> dict[str, Any] | None:
    """The chunk's usage in OpenAI's names (Anthropic's comes in message_delta)."""
    usage = chunk.get("usage")
    if endpoint != "messages" or not usage:
        return usage
    return {"completion_tokens": usage.get("output_tokens"),
            "prompt_tokens": usage.get("input_tokens")}


async def send_request(session: aiohttp.ClientSession, config: ServeConfig,
                       payload: dict[str, Any], prompt_len: int,
                       bench_start: float) -> RequestResult:
    """POSTs one streaming request and times its content chunks; never raises."""
    result = RequestResult(prompt_len=prompt_len)
    url = config.root + ENDPOINTS[config.endpoint]
    sent = time.perf_counter()
    result.start_s = sent - bench_start
    usage: dict[str, Any] | None = None
    done = False
    try:
        async with session.post(url, data=orjson.dumps(payload), headers=config.headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return result
                if _chunk_text(chunk, config.endpoint):
                    result.chunk_times_s.append(time.perf_counter() - sent)
                usage = _chunk_usage(chunk, config.endpoint) or usage
                if chunk.get("type") == "message_stop":  # Anthropic's end: no [DONE]
                    done = True
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - sent
    if not done:
        result.error = "stream ended without [DONE]"
    elif not result.chunk_times_s:
        result.error = "no content"
    else:
        result.success = True
        result.ttft_s = result.chunk_times_s[0]
        result.output_tokens = (usage or {}).get("completion_tokens") or len(result.chunk_times_s)
        result.prompt_len = (usage or {}).get("prompt_tokens") or prompt_len
        result.cached_tokens = ((usage or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens") or 0
    return result


async def fetch_model_name(session: aiohttp.ClientSession, config: ServeConfig) -> str:
    """The first model `/v1/models` lists (what vLLM's benchmark does without --model)."""
    async with session.get(config.root + "/v1/models", headers=config.headers) as resp:
        resp.raise_for_status()
        models = orjson.loads(await resp.read())["data"]
    if not models:
        raise RuntimeError(f"{config.root}/v1/models lists no model")
    return models[0]["id"]


async def run_serve(config: ServeConfig, workload: Workload
                    ) -> tuple[list[RequestResult], float, str]:
    """Runs the workload against the server: (results in workload order, duration s, model).

    One short test request goes first (not timed), so a wrong URL, model or key fails
    fast instead of as N failed requests. Returns after every request finished or failed;
    a failed request is recorded, never raised.
    """
    from tqdm import tqdm

    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    # The semaphore, not the connection pool, bounds concurrency: limit=0 is unbounded.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await fetch_model_name(session, config)
        # A stub of the first prompt: shorter than a KV block, so the probe leaves no
        # prefix-cache entry that would flatter the first timed request.
        first = workload.requests[0]
        stub = BenchRequest(first.prompt_token_ids[:8],
                            None if first.prompt_text is None else first.prompt_text[:24], 2)
        probe = await send_request(session, config, build_payload(stub, config, model),
                                   stub.prompt_len, time.perf_counter())
        if not probe.success:
            raise RuntimeError(f"test request to {config.root} failed: {probe.error}")
        offsets = arrival_offsets(len(workload.requests), config.request_rate,
                                  config.burstiness, config.seed)
        limit = (asyncio.Semaphore(config.max_concurrency) if config.max_concurrency
                 else contextlib.nullcontext())
        bar = tqdm(total=len(workload.requests), desc="requests", unit="req",
                   disable=not config.progress)
        start = time.perf_counter()

        async def one(req: BenchRequest, due: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            async with limit:
                r = await send_request(session, config, build_payload(req, config, model),
                                       req.prompt_len, start)
            bar.update(1)
            return r

        try:
            results = await asyncio.gather(*(one(r, t) for r, t in
                                             zip(workload.requests, offsets)))
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return list(results), duration, model


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="stream requests to an OpenAI-compatible server")
    p.add_argument("--base-url", required=True, help="http://HOST:PORT (a trailing /v1 is fine)")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions",
                   help="messages: Anthropic's /v1/messages (text prompts, as chat)")
    p.add_argument("--model", default=None, help="model name in the API (default: the "
                   "server's first in /v1/models)")
    p.add_argument("--tokenizer", default=None, help="HF directory or .gguf for the dataset "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: unbounded)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    p.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS",
                   help="goodput counts requests within every bound (also e2el:MS)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival times")
    add_workload_args(p)
    p.set_defaults(func=serve_main)


def serve_main(args: argparse.Namespace) -> int:
    import aioengine.bench.report as rep
    from aioengine.bench.offline import load_hf_tokenizer
    from aioengine.model.default import bundled_model_path

    slo = parse_slo(args.slo)
    tokenizer = load_hf_tokenizer(args.tokenizer or bundled_model_path())
    workload = build_workload(args, tokenizer)
    if args.endpoint in ("chat", "messages"):
        workload = with_text(workload, tokenizer)
    config = ServeConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                         api_key=args.api_key, max_concurrency=args.max_concurrency,
                         request_rate=args.request_rate, burstiness=args.burstiness,
                         seed=args.seed, temperature=args.temperature,
                         timeout_s=args.timeout, progress=not args.no_progress)
    results, duration, model = asyncio.run(run_serve(config, workload))
    report = {"mode": "serve", "environment": rep.environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              "summary": summarize(results, duration, slo),
              "requests": [r.to_json() for r in results]}
    emit(report, rep.format_serve(report), args.save_json)
    if args.plot:
        rep.plot_serve(args.plot, results, duration,
                       f"{model} via {args.endpoint}: {len(results)} requests")
        print(f"saved {args.plot}", file=sys.stderr)
    return 0 if report["summary"]["failed_requests"] == 0 else 1
