"""What each supported architecture can do, derived from the code that does it: the README's
table of architectures is generated from here (scripts/gen_arch_table.py; a test checks that
README.md holds the generated table).

    storages       every projection storage (layers.WEIGHT_STORAGES) and, for architectures
                   whose GGUF files the Q4_1 path is checked on (gguf_arch's q4_1_blocks),
                   a GGUF file's own Q4_1 blocks ("gguf")
    GGUF file      the llama.cpp architecture (general.architecture) whose GGUF files load
                   as this one (gguf_arch.gguf_file_architectures), each checked against
                   transformers on a tiny model written as llama.cpp's converter writes it
    fused decode   whether the fused C decode executor runs the architecture's layers, with
                   its transformers default config: no layer option outside the executor's
                   SUPPORTED_FEATURES
    LoRA           architectures whose projections LoRA wraps as PEFT names them (q/k/v/o,
                   gate/up/down) and that tests/lora/test_lora_vs_peft.py checks; Phi-3's
                   fused qkv_proj / gate_up_proj adapters are not read; nor are the MoE
                   models' (their experts are not wrapped, and no test checks them)
    speculative    n-gram, suffix and auto drafts for every architecture (verification is
                   the target's own forward); EAGLE heads only for the Llama family (a head is built as the
                   target's layer: the other families' options would leak into it), so auto
                   takes a head only there
"""
from __future__ import annotations

from dataclasses import dataclass

from aioengine.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig
from aioengine.model.families import FAMILY_MODEL_TYPES
from aioengine.model.gguf_arch import GGUF_ARCHITECTURES, gguf_file_architectures
from aioengine.model.layers import WEIGHT_STORAGES
from aioengine.model.moe_config import MOE_MODEL_TYPES

LLAMA_FAMILY: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
}
EAGLE_TARGET_ARCHITECTURES: frozenset[str] = frozenset(LLAMA_FAMILY.values())
LORA_ARCHITECTURES: frozenset[str] = (frozenset(SUPPORTED_ARCHITECTURES) - {"Phi3ForCausalLM"}
                                       - frozenset(MOE_MODEL_TYPES.values()))


def check_lora_architecture(architecture: str) -> None:
    """ConfigError (fail closed) for an architecture whose adapters LoRA would not apply
    in full: Phi-3's fused checkpoint names, the MoE models' experts."""
    if architecture not in LORA_ARCHITECTURES:
        from aioengine.errors import ConfigError

        raise ConfigError(f"{architecture}: LoRA adapters are not supported for this "
                          "architecture (README.md lists what each one supports)")


@dataclass(frozen=True)
class ArchitectureSupport:
    architecture: str
    model_type: str
    storages: tuple[str, ...]
    gguf_file: str | None
    fused_cpu_decode: bool
    lora: bool
    speculative: tuple[str, ...]


def _model_types() -> dict[str, str]:
    return LLAMA_FAMILY | FAMILY_MODEL_TYPES | MOE_MODEL_TYPES


def fused_decode_supported(model_type: str) -> bool:
    """Whether the fused executor runs every layer of this model type's default config."""
    from transformers import AutoConfig

    from aioengine.model.executors import FusedCpuDecodeExecutor
    from aioengine.model.layer_spec import layer_specs, unsupported

    arch = ModelArchConfig.from_hf_config(AutoConfig.for_model(model_type))
    return not unsupported(layer_specs(arch), FusedCpuDecodeExecutor.SUPPORTED_FEATURES)


def architecture_support() -> list[ArchitectureSupport]:
    """One row per SUPPORTED_ARCHITECTURES entry, in its order."""
    gguf = {a.hf_architecture for a in GGUF_ARCHITECTURES.values() if a.q4_1_blocks}
    gguf_files = gguf_file_architectures()
    by_arch = {arch: mt for mt, arch in _model_types().items()}
    rows = []
    for arch in SUPPORTED_ARCHITECTURES:
        model_type = by_arch[arch]
        storages = WEIGHT_STORAGES + (("gguf",) if arch in gguf else ())
        rows.append(ArchitectureSupport(
            architecture=arch, model_type=model_type, storages=storages,
            gguf_file=gguf_files.get(arch),
            fused_cpu_decode=fused_decode_supported(model_type),
            lora=arch in LORA_ARCHITECTURES,
            speculative=("ngram", "suffix", "auto", "eagle", "eagle3")
            if arch in EAGLE_TARGET_ARCHITECTURES else ("ngram", "suffix", "auto")))
    return rows


def markdown_table() -> str:
    """The README's table of supported architectures."""
    lines = ["| architecture | `model_type` | storages | GGUF file | fused CPU decode | LoRA | "
             "speculative decoding |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in architecture_support():
        gguf_file = f"`{row.gguf_file}`" if row.gguf_file else "no"
        lines.append(f"| `{row.architecture}` | `{row.model_type}` | "
                     f"{', '.join(row.storages)} | {gguf_file} | "
                     f"{'yes' if row.fused_cpu_decode else 'no'} | "
                     f"{'yes' if row.lora else 'no'} | {', '.join(row.speculative)} |")
    return "\n".join(lines) + "\n"
