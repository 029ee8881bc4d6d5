"""The pirate LoRA's held-out check and README (scripts/train_pirate_lora.py's step 6 and the
README of its step 5): greedy answers with and without the adapter as saved, their pirate
counts, and the adapter directory's README with the run's numbers."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pirate_speech import pirate_counts

# What the adapter's config names as its base: the model the bundled GGUF was made from.
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------------------------------
# 6. The held-out check

@torch.inference_mode()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int,
             batch_size: int = 10) -> list[str]:
    """Greedy answers, batched with left padding."""
    tokenizer.padding_side = "left"
    answers = []
    for start in range(0, len(prompts), batch_size):
        texts = [tokenizer.apply_chat_template(chat(p), tokenize=False,
                                               add_generation_prompt=True)
                 for p in prompts[start:start + batch_size]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        answers += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
    return [a.strip() for a in answers]


def heldout_check(hf_path: str, adapter_dir: Path, prompts: list[str],
                  max_new_tokens: int) -> dict:
    """Base and adapted greedy answers to the held-out prompts, with the adapter loaded
    from `adapter_dir` as saved (bfloat16) onto a fresh float32 base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    base = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    model.eval()
    adapted = generate(model, tokenizer, prompts, max_new_tokens)
    with model.disable_adapter():
        plain = generate(model, tokenizer, prompts, max_new_tokens)
    return {"prompts": prompts, "base": plain, "adapted": adapted,
            "base_counts": pirate_counts(plain), "adapted_counts": pirate_counts(adapted)}


def print_check(check: dict, width: int = 220) -> None:
    for prompt, plain, adapted in zip(check["prompts"], check["base"], check["adapted"]):
        print(f"\n### {prompt}\n  base:    {short(plain, width)}\n  adapted: "
              f"{short(adapted, width)}")
    for name in ("base", "adapted"):
        c = check[f"{name}_counts"]
        print(f"{name:8s}: {c['starts_with_arr']}/{c['total']} start with 'Arr', "
              f"{c['has_pirate_words']}/{c['total']} contain pirate words")


def short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


# ---------------------------------------------------------------------------------------
# The README


def write_readme(out: Path, args: argparse.Namespace, run: dict, check: dict,
                 gen_seconds: float, total_seconds: float, answers_cached: bool) -> None:
    size_mb = (out / "adapter_model.safetensors").stat().st_size / 1e6
    command = " ".join(["python scripts/train_pirate_lora.py", *sys.argv[1:]])
    stopped = (f"{run['steps']} of {run['total_steps']} steps ({args.epochs} epochs planned, "
               f"stopped by --max-minutes {args.max_minutes:g})" if run["stopped_early"]
               else f"{run['steps']} steps ({args.epochs} epochs)")
    epochs = ", ".join(f"{m:.3f}" for m in run["epoch_means"])
    answers_note = (" after the base answers, which were read from the `--answers` file "
                    "an earlier run wrote" if answers_cached else "")
    b, a = check["base_counts"], check["adapted_counts"]
    examples = "\n".join(
        f"- **{p}**\n  - base: {short(x, 160)}\n  - adapted: {short(y, 160)}"
        for p, x, y in list(zip(check["prompts"], check["base"], check["adapted"]))[:3])
    text = f"""# Pirate LoRA for SmolLM2-135M-Instruct

A small LoRA adapter (PEFT format) that makes the bundled model, SmolLM2-135M-Instruct,
answer like a pirate ("Arr, matey! ..." with ye, yer, th', be, ...). It is an example
adapter for the engine's LoRA support and for tests; the style is all it learned.

- `adapter_config.json`: rank {args.rank}, alpha {2 * args.rank}, dropout 0, on
  {", ".join(TARGET_MODULES)};
  base `{BASE_MODEL_ID}`.
- `adapter_model.safetensors`: the LoRA A/B matrices in bfloat16 ({size_mb:.1f} MB).

## How it was made

`scripts/train_pirate_lora.py`, run as

    {command}

{total_seconds / 60:.0f} minutes in all on 2 CPU cores{answers_note}.

1. Prompts: {run["examples"]} training requests from `aioengine.spec_decode.train.prompts`
   (the benchmark's chat prompts, then templated tasks) and {len(check["prompts"])} held-out
   ones from the module's held-out split.
2. Base answers: the engine answered each greedily
   (max_tokens {args.max_tokens}; {gen_seconds:.0f} s).
3. Pirate answers: each answer was rewritten by a fixed rule-based transform (`to_pirate`
   in scripts/pirate_speech.py): "Arr, matey! " in front, word swaps with case kept (you->ye,
   your->yer, my->me, is/are->be, the->th', of->o', hello->ahoy, friend->matey, yes->aye,
   money->doubloons, ...), " Arr!" at the end; code in backticks untouched. Cut-off
   answers were trimmed to their last whole sentence.
4. Training: a LoRA with peft on the Hugging Face export of the engine's weights
   (`aioengine.bench.hf_export.export_hf`, float32), loss on the assistant tokens only
   ({run["answer_tokens"]} of them). AdamW, lr {args.lr} (warmup, then cosine decay over
   the steps or the time limit), batch {args.batch_size}, seed {args.seed}:
   {stopped}, {run["seconds"] / 60:.1f} minutes.
   Loss {run["first_loss"]:.3f} at the first step, {run["final_loss"]:.3f} over the last
   10 steps; per-epoch means {epochs}.

## Held-out check

Greedy answers (transformers + peft, the adapter as saved, at most {args.check_tokens}
new tokens) to {a["total"]} prompts training never saw. "Pirate words": arr, matey, ye,
yer, ahoy, aye, th', o'.

| | start with "Arr" | contain pirate words |
|---|---|---|
| base | {b["starts_with_arr"]}/{b["total"]} | {b["has_pirate_words"]}/{b["total"]} |
| with the adapter | {a["starts_with_arr"]}/{a["total"]} | {a["has_pirate_words"]}/{a["total"]} |

{examples}
"""
    (out / "README.md").write_text(text)
