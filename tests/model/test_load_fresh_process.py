"""A GGUF load in a fresh process, where transformers is imported first by the loader's
own threads (the tokenizer's and the config's at once): the first import must not race."""
from __future__ import annotations

import subprocess
import sys

LOAD = """
import torch
from aioengine.model.loader import load_model
loaded = load_model(None, torch.float32, torch.device("cpu"), quantization="gguf")
print(type(loaded.hf_config).__name__)
"""


def test_a_fresh_process_loads_the_bundled_gguf() -> None:
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("LlamaConfig")
