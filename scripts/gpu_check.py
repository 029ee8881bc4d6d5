"""The GPU path's checks on one CUDA device, in one run (scripts/gpu_check.sh calls this).

    python scripts/gpu_check.py --out DIR [--big llama-8b|llama-1b] [--smoke]

1. greedy: our engine (Triton attention, CUDA graphs; then --enforce-eager) against
   transformers on a tiny random Llama in fp32 on the same device and weights;
2. a random-initialised real-shape Llama in bf16 (built on the device, written once as a
   HF checkpoint so both engines read the same weights):
   - single-stream TPOT against the HBM floor (weight bytes / the device's bandwidth),
   - throughput of 64 concurrent requests against transformers' static batching
     (`generate`) and its continuous batching (`generate_batch`, where it exists),
   - the share of the loop's in-step work hidden behind the device (the step timeline);
3. everything into DIR/gpu_check.json (and printed as it goes).

--smoke runs the same code on the CPU at toy sizes (torch attention), to check the script.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioengine import LLM, AsyncEngine, SamplingParams  # noqa: E402

from tests.tiny_models import bundled_tokenizer, make_tiny_model_dir  # noqa: E402

# Nominal HBM bandwidth (bytes/s) by device name; the floor is weight bytes / this.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
BIG_CONFIGS = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "smoke": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=49152),
}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def section(results: dict, name: str, fn: Callable[[], Any]) -> None:
    """Runs one check; a failure is recorded and the next check still runs."""
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    results[name] = {**results[name], "seconds": round(time.perf_counter() - start, 1)}
    log(f"{name}: {json.dumps(results[name], default=str)[:2000]}")


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "cpu": platform.processor()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=p.total_memory / 2**30,
                   capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    return env


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, device) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def greedy_tiny(device: torch.device, smoke: bool) -> dict:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir("llama", Path(tempfile.mkdtemp()) / "tiny", seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 17, 40, 70)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    expected = hf_greedy(hf, prompts, 16, device)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out: dict[str, Any] = {}
    for name, extra in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = LLM(str(path), dtype="float32", device=device.type, max_model_len=256,
                  attention_backend="torch" if smoke else "auto", **extra)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        out[name] = {"equal": got == expected,
                     "tokens_equal": sum(a == b for g, e in zip(got, expected)
                                         for a, b in zip(g, e)),
                     "tokens": sum(len(e) for e in expected),
                     "graphs_captured": llm.cuda_graphs_captured}
        del llm
    return out


def build_big(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Path]:
    """A random real-shape Llama on the device, saved once as a HF checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**BIG_CONFIGS[name], max_position_embeddings=4096, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.02)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    path = Path(tempfile.mkdtemp()) / name
    model.save_pretrained(path)
    tokenizer = bundled_tokenizer()
    tokenizer.save_pretrained(path)
    return model, path


def big_model(name: str, device: torch.device, smoke: bool, concurrency: int) -> dict:
    dtype = torch.float32 if smoke else torch.bfloat16
    t0 = time.perf_counter()
    hf, path = build_big(name, device, dtype)
    res: dict[str, Any] = {"model": name, "build_s": round(time.perf_counter() - t0, 1)}
    vocab = BIG_CONFIGS[name]["vocab_size"]
    rng = random.Random(0)
    prompt_len, new_tokens = (32, 16) if smoke else (128, 128)
    prompts = [[rng.randrange(100, min(vocab, 40000)) for _ in range(prompt_len)]
               for _ in range(concurrency)]
    t0 = time.perf_counter()
    llm = LLM(str(path), dtype=str(dtype).removeprefix("torch."), device=device.type,
              max_model_len=1024, max_num_seqs=concurrency, max_num_batched_tokens=2048,
              attention_backend="torch" if smoke else "auto",
              **({} if smoke else {"gpu_memory_utilization": 0.6}))
    res["load_s"] = round(time.perf_counter() - t0, 1)
    weight_bytes = llm.model.weight_bytes()
    res["weight_gib"] = weight_bytes / 2**30
    res["kv_blocks"] = llm.num_kv_blocks

    def timed(prompts_: list[list[int]], n: int) -> float:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts_, p)
        return time.perf_counter() - start

    timed(prompts[:1], 8)  # warm
    one, many = timed(prompts[:1], 1), timed(prompts[:1], new_tokens + 1)
    tpot = (many - one) / new_tokens
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    bandwidth = next((bw for key, bw in HBM_BANDWIDTH.items() if key in gpu), None)
    res["single_stream"] = {"ttft_ms": one * 1e3, "tpot_ms": tpot * 1e3}
    if bandwidth:
        floor = weight_bytes / bandwidth
        res["single_stream"].update(hbm_floor_ms=floor * 1e3, floor_over_tpot=floor / tpot,
                                    nominal_bandwidth_tb_s=bandwidth / 1e12)
    total = timed(prompts, new_tokens)
    res["ours_throughput_tok_s"] = concurrency * new_tokens / total
    # Same weights, transformers: static batching (one padded batch), then generate_batch.
    with torch.no_grad():
        ids = torch.tensor(prompts, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        res["hf_static_tok_s"] = concurrency * new_tokens / (time.perf_counter() - start)
        if hasattr(hf, "generate_batch"):
            from transformers import GenerationConfig
            try:
                config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                          eos_token_id=-1, pad_token_id=0)
                start = time.perf_counter()
                hf.generate_batch(inputs=prompts, generation_config=config)
                res["hf_generate_batch_tok_s"] = (concurrency * new_tokens
                                                  / (time.perf_counter() - start))
            except Exception as e:  # noqa: BLE001
                res["hf_generate_batch_error"] = f"{type(e).__name__}: {e}"[:500]
    res["ours_over_hf_static"] = res["ours_throughput_tok_s"] / res["hf_static_tok_s"]
    # Greedy agreement on the big model (bf16: rounding differs between the two engines).
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts[:4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))]
    expected = hf_greedy(hf, prompts[:4], 16, device)
    res["greedy_first_token_equal"] = sum(g[0] == e[0] for g, e in zip(got, expected))
    res["greedy_prefix_len"] = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), 16)
                                for g, e in zip(got, expected)]
    del llm
    res["overlap"] = asyncio.run(_overlap(path, dtype, device, smoke, prompts, new_tokens))
    return res


async def _overlap(path: Path, dtype, device, smoke: bool, prompts, new_tokens: int) -> dict:
    engine = await AsyncEngine.create(
        str(path), dtype=str(dtype).removeprefix("torch."), device=device.type,
        max_model_len=1024, max_num_seqs=len(prompts), max_num_batched_tokens=2048,
        attention_backend="torch" if smoke else "auto",
        **({} if smoke else {"gpu_memory_utilization": 0.6}))
    try:
        engine.timeline.enabled = True
        p = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

        async def one(i: int, prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, p, f"o{i}"):
                pass

        start = time.perf_counter()
        await asyncio.gather(*(one(i, pr) for i, pr in enumerate(prompts)))
        elapsed = time.perf_counter() - start
        summary = engine.timeline.summary()
        return {"tok_s": len(prompts) * new_tokens / elapsed,
                "decode": summary.get("decode", {}), "all": summary.get("all", {})}
    finally:
        await engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--big", default="llama-8b", choices=sorted(BIG_CONFIGS))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: checks the script")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    big = "smoke" if args.smoke else args.big
    concurrency = 4 if args.smoke else args.concurrency
    results: dict[str, Any] = {}
    section(results, "environment", lambda: environment(device))
    section(results, "greedy_tiny", lambda: greedy_tiny(device, args.smoke))
    section(results, "big_model", lambda: big_model(big, device, args.smoke, concurrency))
    out = Path(args.out) / "gpu_check.json"
    out.write_text(json.dumps(results, indent=2, default=str))
    log(f"wrote {out}")
    return 0 if not any("error" in v for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
