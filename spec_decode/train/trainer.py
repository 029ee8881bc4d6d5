"""Training the EAGLE-3 head on the self-distilled shards: soft cross-entropy against the
target's top-k next-token probabilities over the draft vocabulary, summed over TTT steps
(weight step_decay ** j), AdamW with warmup and cosine decay. Seeded and resumable: the
batches of an epoch are a function of (seed, epoch), and checkpoints/ holds the trainable
weights, the optimizer's moments (safetensors) and the position (state.json)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aioengine.spec_decode.train.data import make_recorder
from aioengine.spec_decode.train.dataset import (Batch, Dataset, draft_vocabulary, make_batches,
                                                 pad)
from aioengine.spec_decode.train.head import TrainableEagle3, export_head, init_from_head

logger = logging.getLogger("aioengine.train")


@dataclass
class TrainConfig:
    data_dir: str
    output: str
    model: str | None = None  # the target (its embedding and LM head are read)
    aux_layers: tuple[int, ...] | None = None  # None: those the data was recorded with
    draft_vocab_size: int = 8192
    ttt_steps: int = 4
    step_decay: float = 0.8
    epochs: float = 2.0
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    bf16: bool | None = None
    eval_every: int = 100
    max_train_minutes: float | None = None
    n_predict: int | None = None  # written to config.json (default: ttt_steps)
    init_head: str | None = None  # an exported head to start from (fine-tuning)
    seed: int = 0
    log_every: int = 10


def load_target_tables(model: str | None):
    """(arch, embedding [V, H], LM head [V, H]) of the target, float32, without building
    an engine: the loader's own model, its weights unpacked."""
    from aioengine.model.loader import load_model

    loaded = load_model(model, torch.float32, torch.device("cpu"))
    m = loaded.model
    embed = m.embed_tokens.dense_weight().detach()
    lm_head = m.lm_head.dense_weight().detach()
    return loaded.arch, embed, lm_head, loaded.model_path


def step_losses(model: TrainableEagle3, batch: Batch, t2d: Tensor, num_steps: int,
                ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per TTT step: (mean soft cross-entropy, argmax matches [M] bool, origin index [M] of
    each matched row) over the rows whose predicted token is a response token."""
    normed = model(batch.aux, batch.input_ids, num_steps)
    losses, matches, origins = [], [], []
    for j, h in enumerate(normed):
        mask = batch.step_mask(j)
        rows = mask.nonzero(as_tuple=True)
        if rows[0].numel() == 0:
            break
        logits = model.logits(h[rows])
        logp = F.log_softmax(logits, dim=-1)
        ids, probs = batch.labels(j, rows)  # target ids [M, K], probs [M, K]
        draft = t2d[ids]
        p = probs.float() * (draft >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
        losses.append(-(p * logp.gather(-1, draft.clamp(min=0))).sum(-1).mean())
        top1 = logits.argmax(-1)
        matches.append(model_target_ids(model, top1) == ids[:, 0])
        origins.append(rows[0] * batch.input_ids.shape[1] + rows[1])
    return losses, matches, origins


def model_target_ids(model: TrainableEagle3, draft: Tensor) -> Tensor:
    return draft if model.draft_ids is None else model.draft_ids[draft]


@torch.no_grad()
def evaluate(model: TrainableEagle3, batches: list[Batch], t2d: Tensor, num_steps: int,
             bf16: bool) -> dict[str, float]:
    """Held-out loss, per-step greedy accuracy given the earlier steps right, and the mean
    acceptance length at k = num_steps (1 + leading matched steps, teacher-forced) over
    greedy sequences: what the engine's greedy verification would accept."""
    model.eval()
    loss_sum, n_rows = 0.0, 0
    accepted_sum, origins_total = 0.0, 0
    step_hits = [0] * num_steps
    step_rows = [0] * num_steps
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            losses, matches, origins = step_losses(model, batch, t2d, num_steps)
        if not losses:
            continue
        loss_sum += losses[0].item() * matches[0].numel()
        n_rows += matches[0].numel()
        # Leading run of matches per origin (step 0's rows are the origins).
        run = torch.ones(matches[0].numel(), dtype=torch.bool)
        first = origins[0]
        accepted = torch.zeros(first.numel())
        for j, (m, o) in enumerate(zip(matches, origins)):
            hit = torch.zeros_like(run)
            # step j at origin x: the row whose origin index equals x
            pos = torch.searchsorted(first, o)
            hit[pos] = m
            step_hits[j] += int((hit & run).sum())
            step_rows[j] += int(run.sum())
            run = run & hit
            accepted += run.float()
        greedy = batch.greedy_rows(first)
        accepted_sum += float((1 + accepted)[greedy].sum())
        origins_total += int(greedy.sum())
    model.train()
    out = {"heldout_loss": loss_sum / max(n_rows, 1),
           "acceptance_length": accepted_sum / max(origins_total, 1)}
    for j in range(num_steps):
        out[f"acc_{j}"] = step_hits[j] / max(step_rows[j], 1)
    return out


def train(cfg: TrainConfig) -> dict:
    """Trains (or resumes) and exports the head to cfg.output; returns the final metrics."""
    torch.manual_seed(cfg.seed)
    with open(os.path.join(cfg.data_dir, "meta.json")) as f:
        meta = json.load(f)
    aux_layers = tuple(cfg.aux_layers or meta["aux_layers"])
    bf16 = cfg.bf16
    if bf16 is None:
        from aioengine.cpu_info import has_bf16_compute
        bf16 = has_bf16_compute()
    arch, embed, lm_head, target_path = load_target_tables(cfg.model or meta.get("model"))
    train_set = Dataset.load(os.path.join(cfg.data_dir, "train"))
    held_set = Dataset.load(os.path.join(cfg.data_dir, "heldout"))
    recorder = None
    if train_set.online or held_set.online:  # aux states and labels recomputed per batch
        recorder = make_recorder(target_path, meta["dtype"], aux_layers,
                                 meta.get("top_k_labels", 8))
    draft_ids = draft_vocabulary(train_set, arch.vocab_size, cfg.draft_vocab_size)
    t2d = torch.full((arch.vocab_size,), -1, dtype=torch.long)
    if draft_ids is None:
        t2d = torch.arange(arch.vocab_size)
    else:
        t2d[draft_ids] = torch.arange(len(draft_ids))
    model = TrainableEagle3(arch, aux_layers, embed, lm_head, draft_ids,
                            max_positions=max(train_set.max_len, held_set.max_len) + 16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    batches_per_epoch = len(make_batches(train_set, cfg.batch_tokens, cfg.seed, 0))
    total_steps = int(round(cfg.epochs * batches_per_epoch))  # 0: export the initial head
    ckpt = os.path.join(cfg.output, "checkpoints")
    state = {"step": 0, "history": [], "train_s": 0.0, "tokens": 0}
    if os.path.exists(os.path.join(ckpt, "state.json")):
        state = _load_checkpoint(ckpt, model, opt)
        logger.info("resumed at step %d of %d", state["step"], total_steps)
    elif cfg.init_head:
        init_from_head(model, cfg.init_head)
        logger.info("starting from the head in %s", cfg.init_head)
    held_batches = [pad(held_set, g, recorder) for g in make_batches(held_set, cfg.batch_tokens,
                                                            cfg.seed, 0, shuffle=False)]
    coverage = train_set.coverage(draft_ids)
    logger.info("data: %d train sequences (%d tokens), %d held-out; draft vocabulary %d "
                "covers %.2f%% of response tokens; %d steps (%.1f epochs), bf16 %s",
                train_set.num_seqs, train_set.num_tokens, held_set.num_seqs,
                model.draft_vocab_size, 100 * coverage, total_steps, cfg.epochs, bf16)
    bar = _Progress(max(total_steps, 1))
    start, step = time.perf_counter(), state["step"]
    window_loss, window_steps, window_tokens, window_t = 0.0, 0, 0, time.perf_counter()
    stopped_early = False
    while step < total_steps:
        epoch, index = divmod(step, batches_per_epoch)
        batches = make_batches(train_set, cfg.batch_tokens, cfg.seed, epoch)
        for group in batches[index:]:
            if step >= total_steps:
                break
            batch = pad(train_set, group, recorder)
            for param_group in opt.param_groups:
                param_group["lr"] = _lr(cfg, step, total_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                losses, _, _ = step_losses(model, batch, t2d, cfg.ttt_steps)
            loss = sum(cfg.step_decay ** j * l for j, l in enumerate(losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            window_loss += losses[0].item() if losses else 0.0
            window_steps += 1
            window_tokens += batch.num_tokens
            state["tokens"] += batch.num_tokens
            if step % cfg.log_every == 0 or step == total_steps:
                now = time.perf_counter()
                tps = window_tokens / (now - window_t)
                state["history"].append({"step": step, "loss": window_loss / window_steps,
                                         "tokens_per_s": tps})
                bar.update(step, loss=window_loss / window_steps, tps=tps)
                window_loss, window_steps, window_tokens, window_t = 0.0, 0, 0, now
            if step % cfg.eval_every == 0 or step == total_steps:
                metrics = evaluate(model, held_batches, t2d, cfg.ttt_steps, bf16)
                state["history"].append({"step": step, **metrics})
                bar.update(step, acceptance=metrics["acceptance_length"])
                state["step"] = step
                state["train_s"] += time.perf_counter() - start
                _save_checkpoint(ckpt, model, opt, state, cfg)
                start = window_t = time.perf_counter()  # tokens/s counts training only
            if (cfg.max_train_minutes is not None
                    and state["train_s"] + time.perf_counter() - start
                    > 60 * cfg.max_train_minutes):
                stopped_early = True
                break
        if stopped_early:
            break
    bar.close()
    state["step"] = step
    state["train_s"] += time.perf_counter() - start
    metrics = evaluate(model, held_batches, t2d, cfg.ttt_steps, bf16)
    _save_checkpoint(ckpt, model, opt, state, cfg)
    summary = {"target": os.path.basename(target_path), "steps": step,
               "epochs": step / batches_per_epoch, "train_tokens_seen": state["tokens"],
               "train_minutes": state["train_s"] / 60, "draft_vocab_coverage": coverage,
               "train_sequences": train_set.num_seqs, "train_positions": train_set.num_tokens,
               "bf16": bf16, **metrics, "config": {
                   k: v for k, v in dataclasses.asdict(cfg).items()
                   if k not in ("data_dir", "output", "model")}}
    export_head(model, cfg.output, n_predict=cfg.n_predict or cfg.ttt_steps, extra=summary)
    with open(os.path.join(cfg.output, "training.json"), "w") as f:
        json.dump({**summary, "history": state["history"]}, f, indent=1)
    logger.info("head written to %s: %s", cfg.output, json.dumps(metrics))
    return summary


def _lr(cfg: TrainConfig, step: int, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _save_checkpoint(ckpt: str, model: TrainableEagle3, opt: torch.optim.Optimizer,
                     state: dict, cfg: TrainConfig) -> None:
    from safetensors.torch import save_file

    os.makedirs(ckpt, exist_ok=True)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"opt.{names[id(p)]}.{key}"] = s[key].contiguous()
        tensors[f"opt.{names[id(p)]}.step"] = torch.as_tensor(s["step"]).reshape(1).float()
    save_file(tensors, os.path.join(ckpt, "trainer.safetensors.tmp"))
    os.replace(os.path.join(ckpt, "trainer.safetensors.tmp"),
               os.path.join(ckpt, "trainer.safetensors"))
    with open(os.path.join(ckpt, "state.json.tmp"), "w") as f:
        json.dump({**state, "config": dataclasses.asdict(cfg)}, f)
    os.replace(os.path.join(ckpt, "state.json.tmp"), os.path.join(ckpt, "state.json"))
    logger.info("checkpoint saved at step %d (safe to stop)", state["step"])


def _load_checkpoint(ckpt: str, model: TrainableEagle3, opt: torch.optim.Optimizer) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(ckpt, "trainer.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
    for n, p in model.named_parameters():
        if f"opt.{n}.exp_avg" in tensors:
            opt.state[p] = {"exp_avg": tensors[f"opt.{n}.exp_avg"],
                            "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"],
                            "step": tensors[f"opt.{n}.step"].reshape(())}
    with open(os.path.join(ckpt, "state.json")) as f:
        state = json.load(f)
    state.pop("config", None)
    return state


class _Progress:
    """A one-line progress bar on a terminal (loss, tokens/s, held-out acceptance); log
    lines otherwise."""

    def __init__(self, total: int) -> None:
        self.total, self.tty = total, sys.stderr.isatty()
        self.fields: dict[str, float] = {}

    def update(self, step: int, **fields: float) -> None:
        self.fields.update(fields)
        shown = " ".join(f"{k} {v:.3f}" if k != "tps" else f"{v:.0f} tok/s"
                         for k, v in self.fields.items())
        if self.tty:
            width = 30
            done = int(width * step / self.total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} "
                             f"{shown}")
            sys.stderr.flush()
        else:
            logger.info("step %d/%d %s", step, self.total, shown)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")

