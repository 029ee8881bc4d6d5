"""`lora` mode: multi-LoRA against the base model on one engine, in the same run.

    aioengine bench lora [--rounds 2] [--num-prompts 20] [--rank 8] [engine flags]

- Throughput: W1 (32 random prompts of 32-256 tokens, 64 output tokens each, all at once)
  with no adapter, and with 4 adapters assigned round-robin, the two runs alternated for
  `--rounds` rounds (prefix cache reset before each). Reported: total (prompt + output)
  tokens per second of each and the ratio of their sums.
- Single stream: the draft-head trainer's held-out chat prompts one at a time, each without
  and with an adapter back to back (the order rotated per prompt), greedy, natural EOS:
  TPOT of each and their ratio.

The base runs are requests without an adapter on the same LoRA-enabled engine: their steps
never touch an adapter slot (the wrapped projections check one attribute; the fused decode
kernel gets no LoRA table). Unless `--lora-modules` names real PEFT directories, the 4
adapters are random ones of `--rank` on every projection (q/k/v/o/gate/up/down), written to a
temporary directory in PEFT's format: what they compute does not matter here, their cost
does, and it is that of any adapter of the same rank and modules.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any

import torch

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
NUM_ADAPTERS = 4


def write_random_adapter(path: str, module_shapes: dict[tuple[int, str], tuple[int, int]],
                         rank: int, seed: int) -> str:
    """A PEFT adapter directory of `rank` on every projection the engine wraps
    (`module_shapes`: the engine's lora_module_shapes)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, module), (k, n) in module_shapes.items():
        prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=gen) / k ** 0.5
        tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(n, rank, generator=gen)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
                   "target_modules": list(MODULES)}, f)
    return path


async def _final(engine: Any, prompt: Any, params: Any, lora: Any) -> Any:
    out = None
    async for out in engine.generate(prompt, params, lora_request=lora):
        pass
    return out


async def _w1(engine: Any, workload: Any, loras: list[Any]) -> dict[str, float]:
    from aioengine import SamplingParams

    engine.reset_prefix_cache()
    jobs = [_final(engine, r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                    ignore_eos=True),
                   loras[i % len(loras)] if loras else None)
            for i, r in enumerate(workload.requests)]
    start = time.perf_counter()
    outs = await asyncio.gather(*jobs)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.prompt_token_ids) + len(o.outputs[0].cumulative_token_ids)
                 for r, o in zip(workload.requests, outs))
    return {"elapsed_s": elapsed, "total_tokens": tokens, "total_tok_s": tokens / elapsed}


async def _stream(engine: Any, chat: list[dict], max_tokens: int, lora: Any) -> dict[str, float]:
    from aioengine import SamplingParams

    start = time.perf_counter()
    times: list[float] = []
    async for out in engine.generate(chat, SamplingParams(temperature=0, max_tokens=max_tokens),
                                     lora_request=lora):
        times.extend([time.perf_counter() - start] * len(out.outputs[0].token_ids))
    return {"ttft_s": times[0], "decode_s": times[-1] - times[0], "num_tokens": len(times)}


async def run_lora(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from aioengine import AsyncEngine, LoRARequest
    from aioengine.bench.datasets import normal_vocab, random_dataset
    from aioengine.bench.spec import decode_phases
    from aioengine.spec_decode.train.prompts import split_prompts

    engine = await AsyncEngine.create(args.model, **{
        **engine_kwargs, "enable_lora": True, "max_loras": NUM_ADAPTERS,
        "max_cpu_loras": NUM_ADAPTERS, "max_lora_rank": args.rank})
    tmp = tempfile.TemporaryDirectory(prefix="aioengine-bench-lora-")
    try:
        paths = (args.lora_modules.split(",") if args.lora_modules else
                 [write_random_adapter(os.path.join(tmp.name, f"a{i}"), engine.lora_module_shapes,
                                       args.rank, i) for i in range(NUM_ADAPTERS)])
        loras = [await engine.add_lora(LoRARequest(f"a{i}", p)) for i, p in enumerate(paths)]
        workload = random_dataset(normal_vocab(engine.tokenizer), 32, 32, 256, 64, 0)
        await _w1(engine, workload, [])  # warm-up: every shape once, then every slot
        await _w1(engine, workload, loras)
        w1: dict[str, list] = {"base": [], "lora": []}
        for r in range(args.rounds):
            for name in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
                w1[name].append(await _w1(engine, workload, loras if name == "lora" else []))
        single: dict[str, list] = {"base": [], "lora": []}
        records: dict[str, list] = {"base": [], "lora": []}
        chats = [[{"role": "user", "content": p}] for p in split_prompts()[1][:args.num_prompts]]
        engine.timeline.enabled = True
        for i, chat in enumerate(chats):
            for name in (("base", "lora") if i % 2 == 0 else ("lora", "base")):
                single[name].append(await _stream(engine, chat, args.output_len,
                                                  loras[0] if name == "lora" else None))
                records[name] += engine.timeline.records
                engine.timeline.records.clear()
        phases = {name: decode_phases(rs) for name, rs in records.items()}
        lora_stats = {k: v for k, v in engine.stats().items() if k.startswith("lora_")}
    finally:
        await engine.shutdown()
        tmp.cleanup()
    return {"w1": w1, "single": single, "decode_step_ms": phases, "lora_stats": lora_stats,
            "adapters": paths}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    w1 = {name: sum(r["total_tokens"] for r in rs) / sum(r["elapsed_s"] for r in rs)
          for name, rs in result["w1"].items()}
    tpot = {name: 1e3 * sum(r["decode_s"] for r in rs) / max(sum(r["num_tokens"] - 1
                                                                 for r in rs), 1)
            for name, rs in result["single"].items()}
    return {"w1_total_tok_s": w1, "w1_ratio": w1["lora"] / w1["base"],
            "tpot_ms": tpot, "tpot_ratio": tpot["lora"] / tpot["base"]}


def format_lora(report: dict[str, Any]) -> str:
    from aioengine.bench.report import cpu_line

    s = report["summary"]
    return "\n".join([
        cpu_line(report["environment"]),
        f"{NUM_ADAPTERS} adapters of rank {report['rank']} on q/k/v/o/gate/up/down "
        f"({'given' if report['config'].get('lora_modules') else 'random'})",
        f"W1 ({report['rounds']} rounds each): base {s['w1_total_tok_s']['base']:.1f} tok/s, "
        f"4 adapters round-robin {s['w1_total_tok_s']['lora']:.1f} tok/s -> "
        f"{s['w1_ratio']:.3f}x",
        f"single stream ({report['num_prompts']} prompts): TPOT base "
        f"{s['tpot_ms']['base']:.2f} ms, adapter {s['tpot_ms']['lora']:.2f} ms -> "
        f"{s['tpot_ratio']:.3f}x",
        *(f"  mean decode step {name}: prepare {p['prepare']:.2f} / forward {p['forward']:.2f} "
          f"/ sample {p['sample']:.2f} ms ({p['num_steps']} steps)"
          for name, p in report["decode_step_ms"].items()),
        f"adapter memory: {report['lora_stats'].get('lora_cpu_bytes', 0) / 2**20:.1f} MiB in "
        f"CPU memory, slots {report['lora_stats'].get('lora_slot_bytes', 0) / 2**20:.1f} MiB"])


def add_lora_parser(sub: Any) -> None:
    from aioengine.config import add_engine_args

    p = sub.add_parser("lora", help="multi-LoRA vs the base model: W1 throughput with 4 "
                       "adapters round-robin, single-stream TPOT with an adapter")
    p.add_argument("--rounds", type=int, default=2, help="W1 runs of each kind")
    p.add_argument("--num-prompts", type=int, default=20, help="held-out chat prompts")
    p.add_argument("--output-len", type=int, default=128, help="single-stream tokens at most")
    p.add_argument("--rank", type=int, default=8, help="rank of the random adapters")
    p.add_argument("--lora-modules", default=None, metavar="DIR,DIR,DIR,DIR",
                   help=f"{NUM_ADAPTERS} PEFT adapter directories instead of random ones")
    p.add_argument("--save-json", default=None, metavar="PATH")
    add_engine_args(p)
    p.set_defaults(func=lora_main)


def lora_main(args: argparse.Namespace) -> int:
    from aioengine.bench.common import emit, run_config, set_threads
    from aioengine.bench.report import environment_info
    from aioengine.config import engine_kwargs

    set_threads(None)
    if args.lora_modules and len(args.lora_modules.split(",")) != NUM_ADAPTERS:
        raise SystemExit(f"--lora-modules needs {NUM_ADAPTERS} directories")
    result = asyncio.run(run_lora(args, engine_kwargs(args)))
    report = {"mode": "lora", "environment": environment_info(), "model": args.model,
              "config": run_config(args), "rank": args.rank, "rounds": args.rounds,
              "num_prompts": args.num_prompts, "summary": summarize(result), **result}
    emit(report, format_lora(report), args.save_json)
    return 0
