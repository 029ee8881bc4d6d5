"""`aioengine train-eagle` (also `python -m aioengine.spec_decode.train`): builds the
self-distilled data for a target model and trains an EAGLE-3 head on it, resumably."""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time

logger = logging.getLogger("aioengine.train")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="target model: HF directory or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto",
                   help="the target's weights while generating data (as `serve --dtype`)")
    p.add_argument("--output", "-o", required=True,
                   help="the head's directory: config.json + model.safetensors (the final "
                        "head, bf16), checkpoints/ (resumable state) and data/ (shards)")
    p.add_argument("--data", default=None,
                   help="the data directory (default: OUTPUT/data); runs may share one")
    p.add_argument("--stage", choices=("all", "data", "train"), default="all",
                   help="data: only build the data; train: only train on the data there")
    d = p.add_argument_group("data (self-distillation through the engine)")
    d.add_argument("--temperature", type=float, default=0.7,
                   help="temperature of the sampled responses (each prompt also gets a "
                        "greedy one)")
    d.add_argument("--num-sampled", type=int, default=1,
                   help="sampled responses per prompt besides the greedy one (0: greedy only)")
    d.add_argument("--max-tokens", type=int, default=256, help="response length limit")
    d.add_argument("--self-prompts-per-topic", type=int, default=2,
                   help="requests the target writes itself per topic, added to the prompts")
    d.add_argument("--max-prompts", type=int, default=None,
                   help="use only the first N training prompts (a quick run)")
    d.add_argument("--max-heldout-prompts", type=int, default=None,
                   help="use only the first N held-out prompts")
    d.add_argument("--max-num-seqs", type=int, default=64,
                   help="the engine's batch while generating")
    d.add_argument("--online", action="store_true",
                   help="store token ids only; training recomputes the target's aux states "
                        "and labels per batch (a few bytes a position instead of ~3.5 KB)")
    d.add_argument("--corpus", action="store_true",
                   help="train on the templated prompts plus those built from the text "
                        "installed packages ship (spec_decode/train/corpus.py; the `train` "
                        "extra) instead of the benchmark's prompts")
    t = p.add_argument_group("head and training")
    t.add_argument("--aux-layers", default=None,
                   help="comma-separated target layers the head reads (default: vLLM's "
                        "EAGLE-3 choice 2, L/2, L-3)")
    t.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="the head's reduced vocabulary: the most frequent target tokens in "
                        "the data, mapped back through d2t (0: the whole vocabulary)")
    t.add_argument("--ttt-steps", type=int, default=4,
                   help="training-time test: draft steps unrolled per position, each "
                        "reading the previous step's own hidden state")
    t.add_argument("--step-decay", type=float, default=0.8,
                   help="loss weight of draft step j is step_decay ** j")
    t.add_argument("--epochs", type=float, default=2.0, help="passes over the data")
    t.add_argument("--batch-tokens", type=int, default=4096,
                   help="tokens per optimizer step (whole sequences packed up to this)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the matmuls (default: on where the CPU has "
                        "AVX512-BF16 or AMX); master weights stay float32")
    t.add_argument("--eval-every", type=int, default=100,
                   help="optimizer steps between held-out acceptance checks and checkpoints")
    t.add_argument("--n-predict", type=int, default=None,
                   help="draft tokens the engine uses when speculative_config gives no "
                        "num_speculative_tokens, written to config.json (default: --ttt-steps)")
    t.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this exported head's trained weights (fine-tune it on "
                        "the data; its draft vocabulary may differ)")
    t.add_argument("--max-train-minutes", type=float, default=None,
                   help="stop training (and save) after this many minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="aioengine train-eagle",
        description="Train an EAGLE-3 draft head for a target model by self-distillation: "
                    "the target answers the built-in prompts through the engine, its hidden "
                    "states are recorded, and a one-layer head learns to predict its next "
                    "tokens. Resumable: run the same command again to continue.")
    add_train_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.output, exist_ok=True)
    data_dir = args.data or os.path.join(args.output, "data")
    if args.stage in ("all", "data"):
        build_data(args, data_dir)
    if args.stage in ("all", "train"):
        from aioengine.spec_decode.train.trainer import TrainConfig, train

        cfg = TrainConfig(
            data_dir=data_dir, output=args.output, model=args.model,
            aux_layers=_aux_layers(args.aux_layers), draft_vocab_size=args.draft_vocab_size,
            ttt_steps=args.ttt_steps, step_decay=args.step_decay, epochs=args.epochs,
            batch_tokens=args.batch_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
            weight_decay=args.weight_decay, grad_clip=args.grad_clip, bf16=args.bf16,
            eval_every=args.eval_every, max_train_minutes=args.max_train_minutes,
            n_predict=args.n_predict, init_head=args.init_head,
            seed=args.seed)
        train(cfg)
    return 0


def _aux_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    return tuple(int(x) for x in text.split(","))


def corpus_training_prompts(held_out: list[str], seed: int) -> list[str]:
    """The templated prompts and the corpus' (sources interleaved), none of the benchmark's
    and none over a held-out topic."""
    from aioengine.spec_decode.train.corpus import corpus_prompts
    from aioengine.spec_decode.train.prompts import (HELD_OUT_TOPICS, shipped_prompts,
                                                     templated_prompts)

    excluded = set(shipped_prompts()) | set(held_out)
    sources = list(corpus_prompts(HELD_OUT_TOPICS, excluded, seed).values())
    out = [p for p in templated_prompts() if p not in excluded]
    for i in range(max(len(s) for s in sources)):
        out += [s[i] for s in sources if i < len(s)]
    return list(dict.fromkeys(out))


def build_data(args: argparse.Namespace, data_dir: str) -> None:
    """The held-out and training shards in data_dir/heldout and data_dir/train."""
    from aioengine.engine.llm import LLM
    from aioengine.spec_decode.eagle import default_aux_layer_ids
    from aioengine.spec_decode.train.data import DataConfig, generate_data, write_meta, \
        write_self_prompts
    from aioengine.spec_decode.train.prompts import TOPICS, split_prompts

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=args.seed)
    arch = llm.model_arch
    aux = _aux_layers(args.aux_layers) or default_aux_layer_ids(arch.num_hidden_layers)
    os.makedirs(data_dir, exist_ok=True)
    prompts_file = os.path.join(data_dir, "prompts.json")
    if os.path.exists(prompts_file):  # resuming: the same prompts in the same order
        with open(prompts_file) as f:
            saved = json.load(f)
        train_prompts, held_out = saved["train"], saved["heldout"]
    else:
        train_prompts, held_out = split_prompts(args.seed)
        if args.corpus:
            train_prompts = corpus_training_prompts(held_out, args.seed)
        own = write_self_prompts(llm, TOPICS, args.self_prompts_per_topic, args.seed)
        held = set(held_out)
        train_prompts += [q for q in own if q not in held]
        random.Random(args.seed).shuffle(train_prompts)
        with open(prompts_file, "w") as f:
            json.dump({"train": train_prompts, "heldout": held_out,
                       "num_self_written": len(own)}, f, indent=1)
    if args.max_prompts:
        train_prompts = train_prompts[:args.max_prompts]
    if args.max_heldout_prompts:
        held_out = held_out[:args.max_heldout_prompts]
    start = time.perf_counter()

    def progress(done: int, total: int, gen_tps: float, rec_tps: float) -> None:
        if args.online:  # nothing is recorded: training recomputes the aux states
            logger.info("data shard %d/%d: generated %.0f tok/s", done, total, gen_tps)
        else:
            logger.info("data shard %d/%d: generated %.0f tok/s, recorded %.0f tok/s",
                        done, total, gen_tps, rec_tps)

    base = dict(temperature=args.temperature, num_sampled=args.num_sampled,
                max_tokens=args.max_tokens, seed=args.seed, record=not args.online)
    meta = {"model": llm.model_path, "aux_layers": list(aux),
            "dtype": str(llm.dtype), "num_train_prompts": len(train_prompts),
            "num_heldout_prompts": len(held_out), **base}
    write_meta(data_dir, meta)  # before the shards: a stopped run's shards are usable
    held_stats = generate_data(llm, held_out, aux, DataConfig(
        os.path.join(data_dir, "heldout"), **base), progress)
    train_stats = generate_data(llm, train_prompts, aux, DataConfig(
        os.path.join(data_dir, "train"), **base), progress)
    write_meta(data_dir, {**meta, "train": train_stats, "heldout": held_stats,
                          "wall_s": time.perf_counter() - start})


if __name__ == "__main__":
    sys.exit(main())
