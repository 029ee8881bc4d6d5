"""KV blocks held by one long sequence with a sliding window against full attention.

Builds tiny random models of 4 layers that differ only in their attention: a Mistral with
full attention, the same with `sliding_window` W on every layer, and a Qwen2 whose first
layer attends to everything and the other three to a window (`max_window_layers`, as
Gemma's and Qwen2's mixed models do: KV cache groups). Runs one prompt of --prompt-len
tokens plus --new-tokens through each engine and prints the peak of blocks held summed over
layers (`kv_peak_layer_blocks`), with what that would be in bytes at Mistral-7B's KV shape
per layer (8 KV heads x 128, bf16).

    .venv/bin/python scripts/sliding_window_kv.py --prompt-len 8192 --window 4096
"""
from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from transformers import (AutoTokenizer, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from aioengine import LLM, SamplingParams
from aioengine.model.default import bundled_model_path

NUM_LAYERS = 4
LAYER_KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # K and V, Mistral-7B's KV heads x dim, bf16


def bundled_tokenizer():
    gguf = Path(bundled_model_path())
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def make_model(path: Path, kind: str, window: int, max_len: int, tokenizer) -> Path:
    """kind: "full", "window" (every layer) or "mixed" (layer 0 full, the rest windowed)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=max_len, tie_word_embeddings=False)
    if kind == "mixed":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True,
                                             sliding_window=window, max_window_layers=1))
    else:
        model = MistralForCausalLM(MistralConfig(
            **shape, sliding_window=window if kind == "window" else None))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def peak_blocks(path: Path, prompt: list[int], args: argparse.Namespace) -> tuple[int, int]:
    llm = LLM(str(path), dtype="float32", max_model_len=args.max_len,
              block_size=args.block_size, max_num_batched_tokens=args.chunk)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    return int(llm.stats()["kv_peak_layer_blocks"]), len(out.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    args = parser.parse_args()
    args.max_len = args.prompt_len + args.new_tokens + 1
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    rows, tokenizer = [], bundled_tokenizer()
    kinds = (("full attention", "full"), (f"window {args.window}", "window"),
             ("1 full + 3 window", "mixed"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind in kinds:
            path = make_model(Path(tmp) / kind, kind, args.window, args.max_len, tokenizer)
            blocks, generated = peak_blocks(path, prompt, args)
            rows.append((name, blocks, generated))
    full = rows[0][1]
    print(f"{args.prompt_len}-token prompt + {args.new_tokens} new, blocks of "
          f"{args.block_size}, prefill chunks of {args.chunk}, {NUM_LAYERS} layers")
    for name, blocks, generated in rows:
        gib = blocks * args.block_size * LAYER_KV_BYTES_PER_TOKEN / 2**30
        print(f"{name:>18}: peak {blocks:5d} layer-blocks ({blocks / full:.2f}x full), "
              f"{gib:.3f} GiB at Mistral-7B's per-layer KV shape, {generated} tokens")

if __name__ == "__main__":
    main()
