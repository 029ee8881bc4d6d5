"""Embedding throughput (prompt tokens/s) of LLM.embed against transformers, in the same
process, interleaved (A B A B ...), on the shipped prompts (aioengine/bench/data) and the
bundled SmolLM2-135M-Instruct as a Hugging Face export (the same float32 weights for both).

transformers: the base model (no LM head) in batches of --hf-batch prompts, right-padded
with an attention mask, the last real token's `last_hidden_state` (after the final norm)
pooled and L2-normalised, under torch.inference_mode(). aioengine: LLM.embed of every
prompt at once (the scheduler batches them, max_num_batched_tokens per step).

    .venv/bin/python scripts/embed_throughput.py --rounds 3 [--pooling last|mean|cls]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from aioengine import cpu_info
from aioengine.bench.datasets import load_prompt_texts
from aioengine.bench.hf_export import export_hf
from aioengine.engine.llm import LLM


def hf_embed(model, tokenizer, texts: list[str], pooling: str, batch: int) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True)
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"]
            if pooling == "last":
                vec = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
            elif pooling == "mean":
                vec = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            else:
                vec = hidden[:, 0]
            out.append(torch.nn.functional.normalize(vec.float(), dim=-1))
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pooling", default="last", choices=("last", "mean", "cls"))
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    from transformers import AutoModel, AutoTokenizer

    path = export_hf()
    texts = load_prompt_texts()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32",
              max_num_batched_tokens=args.max_num_batched_tokens)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    print(f"CPU: {cpu_info.cpu_model()}; flags: {' '.join(cpu_info.relevant_flags())}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{len(texts)} prompts, {num_tokens} tokens, pooling {args.pooling}")
    rates: dict[str, list[float]] = {"aioengine": [], "transformers": []}
    ours = theirs = None
    for r in range(args.rounds):
        start = time.perf_counter()
        outs = llm.embed(texts, pooling=args.pooling, use_tqdm=False)
        rates["aioengine"].append(num_tokens / (time.perf_counter() - start))
        ours = torch.stack([o.outputs.data for o in outs])
        start = time.perf_counter()
        theirs = hf_embed(hf, tokenizer, texts, args.pooling, args.hf_batch)
        rates["transformers"].append(num_tokens / (time.perf_counter() - start))
        print(f"round {r}: aioengine {rates['aioengine'][-1]:8.0f} tok/s, transformers "
              f"{rates['transformers'][-1]:8.0f} tok/s, ratio "
              f"{rates['aioengine'][-1] / rates['transformers'][-1]:.2f}")
    assert ours is not None and theirs is not None
    print(f"max |difference| of the vectors: {(ours - theirs).abs().max().item():.2e}")
    a, b = statistics.median(rates["aioengine"]), statistics.median(rates["transformers"])
    print(f"median: aioengine {a:.0f} tok/s, transformers {b:.0f} tok/s, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
