"""Tiny random models that "think": the bundled SmolLM2 tokenizer with `<think>` and
`</think>` added as single tokens (not special, as Qwen3 and the DeepSeek-R1 distills have
them, so they stay in decoded text) and a ChatML template that opens or closes them.

    path = make_thinking_model_dir(tmp_path / "m", style="qwen3")
    # aioengine serve path --reasoning-parser qwen3

Styles (THINKING_TEMPLATES):
- "qwen3": Qwen3's switch: with `enable_thinking=False` (a chat_template_kwargs variable)
  the generation prompt ends with an empty, closed `<think>\\n\\n</think>\\n\\n` block;
  not given, it writes no tag and the model opens `<think>` itself (Qwen3's default);
  `enable_thinking=True` opens `<think>\\n` in the prompt (as Qwen3's 2507 thinking
  models' templates do), so one server covers the three places an output can start.
- "deepseek_r1": the generation prompt opens `<think>\\n` itself (DeepSeek-R1's template
  since its 0528 update and the distills'), so the output starts inside the reasoning.

Both render past assistant turns without their reasoning (as Qwen3's template drops it).
The weights are random: a test forces reasoning text into the output with a grammar (its
text holds the tags) or logit_bias, as the tool tests force calls.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tiny_models import bundled_tokenizer, make_tiny_model_dir

THINK_TOKENS = ("<think>", "</think>")

_TURNS = ("{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- set content = message['content'] if message['content'] is string else '' %}"
          "{%- if message['role'] == 'assistant' and '</think>' in content %}"
          "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
          "{%- endif %}"
          "{{- content + '<|im_end|>\\n' }}"
          "{%- endfor %}")
THINKING_TEMPLATES: dict[str, str] = {
    "qwen3": _TURNS + ("{%- if add_generation_prompt %}"
                       "{{- '<|im_start|>assistant\\n' }}"
                       "{%- if enable_thinking is defined and enable_thinking is false %}"
                       "{{- '<think>\\n\\n</think>\\n\\n' }}"
                       "{%- elif enable_thinking is defined and enable_thinking %}"
                       "{{- '<think>\\n' }}"
                       "{%- endif %}"
                       "{%- endif %}"),
    "deepseek_r1": _TURNS + ("{%- if add_generation_prompt %}"
                             "{{- '<|im_start|>assistant\\n<think>\\n' }}"
                             "{%- endif %}"),
}
# The model's vocabulary: room for the two added tokens (49152 + 2), rounded up.
VOCAB_SIZE = 49216


def thinking_tokenizer(style: str = "qwen3") -> Any:
    """A copy of the bundled tokenizer with the think tokens and `style`'s template."""
    from tokenizers import AddedToken

    if style not in THINKING_TEMPLATES:
        raise ValueError(f"unknown thinking style {style!r}; choose from "
                         f"{sorted(THINKING_TEMPLATES)}")
    tok = copy.deepcopy(bundled_tokenizer())
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = THINKING_TEMPLATES[style]
    return tok


def make_thinking_model_dir(path: Path, style: str = "qwen3", *, arch: str = "qwen3",
                            seed: int = 0) -> Path:
    """Writes a tiny `arch` model with thinking_tokenizer(style) to `path`."""
    return make_tiny_model_dir(arch, path, seed=seed, tokenizer=thinking_tokenizer(style),
                               vocab_size=VOCAB_SIZE)
