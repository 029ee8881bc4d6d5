"""Trains a LoRA adapter that makes the bundled SmolLM2-135M-Instruct answer like a pirate.

    .venv/bin/python scripts/train_pirate_lora.py                  # -> lora/examples/pirate/
    .venv/bin/python scripts/train_pirate_lora.py --epochs 2 --max-minutes 10 --out /tmp/p

What it does, start to end (about 20-25 minutes on 2 idle CPU cores, nothing downloaded):

1. Prompts: a few hundred user requests from `aioengine.spec_decode.train.prompts` (the
   benchmark's chat prompts and the templated tasks), and ~20 prompts from that module's
   held-out split, which training never sees.
2. Base answers: the engine (`aioengine.LLM`, the bundled GGUF) answers every prompt
   greedily, as a chat.
3. Pirate answers: each answer goes through `to_pirate`, a deterministic rule-based rewrite
   ("Arr, matey! " in front, you->ye, the->th', is->be, ... " Arr!" at the end). Code in
   backticks is left alone.
4. Training: a LoRA (peft; r=8 on every attention and MLP projection) on the Hugging Face
   form of the same weights (`aioengine.bench.hf_export.export_hf`), with a plain torch
   loop: AdamW, length-grouped padded batches, loss on the assistant tokens only. The
   learning rate decays with the share of the steps or of --max-minutes done, whichever
   is larger, so a run the time limit cuts short still ends annealed.
5. Saving: `adapter_config.json` and `adapter_model.safetensors` (bfloat16, ~5 MB) and a
   README.md with the run's numbers, into the output directory; nothing else lands there.
6. Check: greedy answers to the held-out prompts with and without the adapter (transformers
   + peft, the adapter as saved), printed, and a count of the pirate-sounding ones.

Pass `--answers FILE` to keep the base answers in a JSON file and reuse them on a rerun.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pirate_report import (BASE_MODEL_ID, TARGET_MODULES, chat, heldout_check, print_check,
                           short, write_readme)
from pirate_speech import to_pirate, trim_to_sentence

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "lora" / "examples" / "pirate"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
IGNORE_INDEX = -100  # label of a token the loss skips (the prompt, the padding)


@dataclass
class Example:
    """One training example: the user's request and the answer to learn."""

    prompt: str
    answer: str
    complete: bool  # the answer ends the turn (an end-of-turn token follows it)


# ---------------------------------------------------------------------------------------
# 1. Prompts


def choose_prompts(num_train: int, num_heldout: int, seed: int) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts). Training: the shipped benchmark prompts of the
    module's training split first (they are the most varied), then templated tasks, in the
    split's seeded shuffled order. Held-out: every 3rd prompt of the held-out split (shipped
    prompts and templated prompts over topics training never sees)."""
    from aioengine.spec_decode.train.prompts import shipped_prompts, split_prompts

    train, held_out = split_prompts(seed)
    shipped = set(shipped_prompts())
    ordered = [p for p in train if p in shipped] + [p for p in train if p not in shipped]
    return ordered[:num_train], held_out[::3][:num_heldout]


# ---------------------------------------------------------------------------------------
# 2. Base answers


def base_answers(prompts: list[str], max_tokens: int, seed: int) -> list[tuple[str, bool]]:
    """The engine's greedy answer to each prompt: (text, whether it finished on its own)."""
    from aioengine import LLM, SamplingParams

    llm = LLM(seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([chat(p) for p in prompts], params)
    answers = [(o.outputs[0].text.strip(), o.outputs[0].finish_reason == "stop") for o in outs]
    del llm, outs
    gc.collect()
    return answers


def load_or_generate_answers(prompts: list[str], max_tokens: int, seed: int,
                             cache: Path | None) -> tuple[list[tuple[str, bool]], float, bool]:
    """(base answers, the seconds generating them took, whether they were read from `cache`):
    read from `cache` when it holds these prompts, else generated (and written to `cache`
    when one is given)."""
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("prompts") == prompts and saved.get("max_tokens") == max_tokens:
            log(f"base answers: read from {cache}")
            return ([(a, done) for a, done in saved["answers"]], saved.get("seconds", 0.0),
                    True)
    t0 = time.perf_counter()
    answers = base_answers(prompts, max_tokens, seed)
    seconds = time.perf_counter() - t0
    log(f"base answers: {len(answers)} generated in {seconds:.0f} s, "
        f"{sum(done for _, done in answers)} finished before max_tokens={max_tokens}")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                     "seconds": seconds, "answers": answers}, indent=1))
    return answers, seconds, False


# ---------------------------------------------------------------------------------------
# 3. The pirate rewrite (pirate_speech.py)


def make_examples(prompts: list[str], answers: list[tuple[str, bool]]) -> list[Example]:
    """Pirate examples; a cut-off answer is trimmed to a whole sentence when it can be
    (then it counts as complete), else kept as it is, without an end of turn."""
    examples = []
    for prompt, (answer, done) in zip(prompts, answers):
        if not answer:
            continue
        if not done:
            trimmed = trim_to_sentence(answer)
            if trimmed is not None:
                answer, done = trimmed, True
        examples.append(Example(prompt, to_pirate(answer, done), done))
    return examples


# ---------------------------------------------------------------------------------------
# 4. Training


def encode_example(tokenizer, ex: Example) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a chat with the pirate answer; the labels keep the answer
    and its end-of-turn token, and mask the system/user turns with IGNORE_INDEX."""
    prompt = tokenizer.apply_chat_template(chat(ex.prompt), tokenize=False,
                                           add_generation_prompt=True)
    full = tokenizer.apply_chat_template(
        chat(ex.prompt) + [{"role": "assistant", "content": ex.answer}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template's conversation does not start with its prompt")
    end_of_turn = tokenizer.eos_token  # "<|im_end|>"
    answer_text = full[len(prompt):]
    # Up to and including the end-of-turn token (not the newline the template puts after
    # it); a cut-off answer stops before it.
    answer_text = answer_text[:answer_text.index(end_of_turn) + (len(end_of_turn)
                                                                 if ex.complete else 0)]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids


def batches(encoded: list[tuple[list[int], list[int]]], batch_size: int,
            rng: random.Random) -> list[list[int]]:
    """One epoch's batches of example indices: shuffled, then sorted by length within
    groups of 8 batches so that a batch holds examples of similar length (less padding)."""
    order = list(range(len(encoded)))
    rng.shuffle(order)
    group = batch_size * 8
    out = []
    for start in range(0, len(order), group):
        chunk = sorted(order[start:start + group], key=lambda i: len(encoded[i][0]))
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels."""
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (x, y) in enumerate(items):
        ids[row, :len(x)] = torch.tensor(x)
        labels[row, :len(y)] = torch.tensor(y)
        mask[row, :len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lr_at(step: int, warmup: int, progress: float, peak: float) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to a tenth of it as
    `progress` (the share of the run done, 0..1) goes to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def add_lora(model, rank: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                        target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def train(model, tokenizer, examples: list[Example], args: argparse.Namespace) -> dict:
    """The LoRA training loop; returns the loss history and timing."""
    encoded = [encode_example(tokenizer, ex) for ex in examples]
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(encoded) / args.batch_size)
    total = steps_per_epoch * args.epochs
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    tokens = sum(sum(1 for t in y if t != IGNORE_INDEX) for _, y in encoded)
    log(f"training: {len(encoded)} examples, {tokens} answer tokens, {steps_per_epoch} "
        f"steps/epoch x {args.epochs} epochs, lr {args.lr}, batch {args.batch_size}")
    model.train()
    history: list[dict] = []
    epoch_means: list[float] = []
    step, t0, stopped_early = 0, time.perf_counter(), False
    budget = args.max_minutes * 60
    for epoch in range(args.epochs):
        epoch_losses = []
        for batch in batches(encoded, args.batch_size, rng):
            if time.perf_counter() - t0 > budget:
                stopped_early = True
                break
            # The share done: of the steps, or of --max-minutes when that runs out first,
            # so that a run the clock cuts short still ends with a decayed rate.
            progress = max(step / total, (time.perf_counter() - t0) / budget)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, max(1, total // 20), progress, args.lr)
            loss = model(**collate([encoded[i] for i in batch], tokenizer.pad_token_id)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            epoch_losses.append(loss.item())
            history.append({"step": step, "epoch": epoch + 1, "loss": loss.item()})
            if step % args.log_every == 0 or step == 1:
                recent = [h["loss"] for h in history[-args.log_every:]]
                log(f"  step {step:4d}/{total} epoch {epoch + 1} loss "
                    f"{sum(recent) / len(recent):.4f} ({time.perf_counter() - t0:.0f} s)")
        if epoch_losses:
            epoch_means.append(sum(epoch_losses) / len(epoch_losses))
            log(f"epoch {epoch + 1}: mean loss {epoch_means[-1]:.4f} over "
                f"{len(epoch_losses)} steps")
        if stopped_early:
            log(f"stopped: --max-minutes {args.max_minutes} reached at step {step}")
            break
    model.eval()
    last = [h["loss"] for h in history[-10:]]
    return {"history": history, "steps": step, "total_steps": total,
            "seconds": time.perf_counter() - t0, "stopped_early": stopped_early,
            "final_loss": sum(last) / max(1, len(last)), "epoch_means": epoch_means,
            "first_loss": history[0]["loss"] if history else float("nan"),
            "examples": len(encoded), "answer_tokens": tokens}


# ---------------------------------------------------------------------------------------
# 5. Saving


def save_adapter(model, out: Path) -> None:
    """adapter_config.json and a bfloat16 adapter_model.safetensors into `out` (other files
    peft writes, such as its model card, are not kept)."""
    from safetensors.torch import load_file, save_file

    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        weights = load_file(str(Path(tmp) / "adapter_model.safetensors"))
        weights = {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}
        save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_model.safetensors").chmod(0o644)
        shutil.copyfile(Path(tmp) / "adapter_config.json", out / "adapter_config.json")


# ---------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="adapter directory to write")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha is twice it)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-minutes", type=float, default=20.0,
                   help="stop training after this many minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-train", type=int, default=300, help="training prompts")
    p.add_argument("--num-heldout", type=int, default=20, help="held-out check prompts")
    p.add_argument("--max-tokens", type=int, default=96, help="base answer length limit")
    p.add_argument("--check-tokens", type=int, default=64,
                   help="new tokens per answer in the held-out check")
    p.add_argument("--answers", type=Path, default=None,
                   help="JSON file to keep the base answers in and reuse them from")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--log-every", type=int, default=5)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_prompts, heldout_prompts = choose_prompts(args.num_train, args.num_heldout,
                                                    args.seed)
    log(f"prompts: {len(train_prompts)} for training, {len(heldout_prompts)} held out")
    answers, gen_seconds, answers_cached = load_or_generate_answers(
        train_prompts, args.max_tokens, args.seed, args.answers)
    examples = make_examples(train_prompts, answers)
    log(f"examples: {len(examples)}, {sum(e.complete for e in examples)} complete; e.g.\n"
        f"  {short(examples[0].prompt, 100)}\n  -> {short(examples[0].answer, 300)}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aioengine.bench.hf_export import export_hf

    hf_path = export_hf()
    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    model = add_lora(AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32),
                     args.rank)
    model.print_trainable_parameters()
    run = train(model, tokenizer, examples, args)
    save_adapter(model, args.out)
    del model
    gc.collect()

    check = heldout_check(hf_path, args.out, heldout_prompts, args.check_tokens)
    print_check(check)
    total = time.perf_counter() - t_start
    write_readme(args.out, args, run, check, gen_seconds, total, answers_cached)
    for name in (*ADAPTER_FILES, "README.md"):
        log(f"{args.out / name}: {(args.out / name).stat().st_size:,} bytes")
    log(f"done in {total / 60:.1f} minutes; final loss {run['final_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
