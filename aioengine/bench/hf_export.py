"""A GGUF model written out as a Hugging Face directory, for peers that only read those (vLLM).

    path = export_hf()                       # the bundled SmolLM2, float32, cached
    path = export_hf("/x/m.gguf", "bfloat16")
    aioengine bench export-hf [MODEL] [--dtype float32|bfloat16|float16] [--out DIR]

The weights are the ones our engine runs: `gguf_loader` dequantizes them (q/k rows back in
Hugging Face order) and they are saved as one `model.safetensors`, with the config the GGUF
metadata describes and the tokenizer (chat template included) that transformers reads from
the same file. float32 is the default because it holds the dequantized values exactly; a
peer casts to its own dtype on load (`--vllm-dtype`).

Exports are cached under `envs.cache_root()`/hf-export/ (`$AIOENGINE_CACHE_DIR`, else
`$XDG_CACHE_HOME/aioengine`, else `~/.cache/aioengine`),
keyed by the GGUF's path, size and modification time, the dtype and FORMAT_VERSION, and
written to a temporary directory that is renamed into place, so a half-written export is
never reused. A Hugging Face directory given as the model is returned as it is.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from aioengine import envs

# Bump when what an export contains changes, so old caches are not reused.
FORMAT_VERSION = 1
EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16}
WEIGHTS_FILE = "model.safetensors"


def cache_root() -> Path:
    """envs.cache_root()/hf-export: exports live beside the start-up cache."""
    return envs.cache_root() / "hf-export"


def export_key(gguf_path: str, dtype: str) -> str:
    """Names an export: the file (path, size, mtime), the dtype and FORMAT_VERSION."""
    st = os.stat(gguf_path)
    ident = json.dumps([os.path.abspath(gguf_path), st.st_size, st.st_mtime_ns, dtype,
                        FORMAT_VERSION])
    stem = Path(gguf_path).name.removesuffix(".gguf")
    return f"{stem}-{dtype}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def export_hf(model: str | None = None, dtype: str = "float32",
              out_dir: str | None = None) -> str:
    """The path of a Hugging Face directory holding `model` (None: the bundled GGUF)."""
    from aioengine.model.loader import resolve_model_path

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        return path  # already a Hugging Face directory
    target = Path(out_dir) if out_dir else cache_root() / export_key(path, dtype)
    if (target / WEIGHTS_FILE).is_file() and (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep other users' peers out
        write_hf_dir(path, tmp, EXPORT_DTYPES[dtype])
        if target.exists():  # an explicit --out that holds an older or partial export
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target)


def write_hf_dir(gguf_path: str, out: Path, dtype: torch.dtype) -> None:
    """config.json, the tokenizer files and model.safetensors of a GGUF file, into `out`."""
    from safetensors.torch import save_file

    from aioengine.model import gguf_loader
    from aioengine.model.loader import load_tokenizer

    reader = gguf_loader.FastGGUFReader(gguf_path)
    if gguf_loader.rope_freq_factors(reader) is not None:
        # Our engine applies llama.cpp's per-frequency factors directly; a config.json would
        # need them turned back into rope_scaling parameters, which we do not do.
        raise NotImplementedError(f"{gguf_path}: exporting llama3 rope scaling (rope_freqs) "
                                  "to a Hugging Face config is not supported")
    config = gguf_loader.gguf_hf_config(reader)
    config.dtype = dtype
    weights = {name: t.to(dtype).contiguous() for name, t in gguf_loader.iter_gguf_weights(
        reader, config.num_attention_heads, config.num_key_value_heads)}
    config.save_pretrained(out)
    _add_legacy_config_keys(out / "config.json")
    load_tokenizer(gguf_path).save_pretrained(out)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def _add_legacy_config_keys(path: Path) -> None:
    """Also the names older readers look for: transformers 5 writes `dtype` and
    `rope_parameters`; 4.x reads `torch_dtype` and a top-level `rope_theta` (without it,
    silently 10000)."""
    config = json.loads(path.read_text())
    config.setdefault("torch_dtype", config.get("dtype"))
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def add_export_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export-hf", help="write a GGUF as a Hugging Face directory (for vLLM)")
    p.add_argument("model", nargs="?", default=None,
                   help=".gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="float32",
                   help="dtype of the saved weights (float32 keeps the dequantized values)")
    p.add_argument("--out", default=None,
                   help=f"directory to write (default: a cached one under {cache_root()})")
    p.set_defaults(func=export_main)


def export_main(args: argparse.Namespace) -> int:
    print(export_hf(args.model, args.dtype, args.out))
    return 0
