"""The loss curve and held-out acceptance of an EAGLE head's training, as a PNG:

    python scripts/plot_eagle_training.py HEAD_DIR/training.json docs/eagle-head-training.png

(matplotlib: the `bench` extra)."""
from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src) as f:
        run = json.load(f)
    hist = run["history"]
    train = [(h["step"], h["loss"]) for h in hist if "loss" in h]
    evals = [h for h in hist if "heldout_loss" in h]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(*zip(*train), label="train (draft step 0)")
    ax1.plot([h["step"] for h in evals], [h["heldout_loss"] for h in evals], "o-",
             label="held-out (draft step 0)")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("soft cross-entropy")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.plot([h["step"] for h in evals], [h["acceptance_length"] for h in evals], "o-",
             color="C2")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel(f"acceptance length at k = {run['config']['ttt_steps']}")
    ax2.set_title("held-out, greedy, teacher-forced")
    fig.suptitle(f"EAGLE-3 head for {run['target']}: {run['train_positions']} positions, "
                 f"{run['epochs']:.1f} epochs, {run['train_minutes']:.0f} min")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
