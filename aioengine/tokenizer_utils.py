"""Prompt-side tokenizer helpers: plain prompts, chat templates, EOS ids."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """Messages cannot be rendered: no chat template, malformed messages, or the template
    itself failed."""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a plain-text prompt, with the special tokens (e.g. BOS) the model's
    tokenizer adds by default (SmolLM2 adds none; Llama-style tokenizers add BOS)."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def _content_text(content: Any, index: int) -> str:
    """A message's content as text: a string, or text parts joined with newlines."""
    if content is None:  # OpenAI allows null content (e.g. an assistant tool call)
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of "
                                f"parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where} must be an object, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ChatTemplateError(
                f"{where} has unsupported type {part.get('type')!r}; only 'text' parts are "
                "supported")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where} needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Validated copies of chat messages with string content (other keys kept)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, "
                                    f"got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ChatTemplateError(f"messages[{i}] needs a non-empty string 'role'")
        if "content" not in message and not message.get("tool_calls"):
            raise ChatTemplateError(f"messages[{i}] needs 'content'")
        normalized.append({**message, "content": _content_text(message.get("content"), i)})
    return normalized


def render_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                         add_generation_prompt: bool = True, tools: list[dict] | None = None,
                         chat_template: str | None = None,
                         chat_template_kwargs: dict | None = None) -> str:
    """The prompt text the chat template (the model's, or `chat_template`) makes of
    `messages`; `tools` (Chat Completions' tool objects) go to templates that take them;
    `chat_template_kwargs`: extra variables for the template (e.g. enable_thinking)."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; send a plain prompt instead")
    normalized = normalize_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            normalized, tools=tools, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
    except Exception as e:  # jinja2 errors, raise_exception() in the template, ...
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template rendered {type(text).__name__}, not text")
    return text


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                        add_generation_prompt: bool = True, tools: list[dict] | None = None,
                        chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` rendered by the model's chat template. Messages have `role`
    and `content` (a string, or a list of {"type": "text", "text": ...} parts, joined with
    newlines). The template writes its own special tokens (BOS included), so the text is
    encoded without adding any, as transformers does."""
    text = render_chat_template(tokenizer, messages, add_generation_prompt, tools,
                                chat_template)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def get_eos_token_ids(tokenizer: PreTrainedTokenizerBase, hf_config: Any = None) -> set[int]:
    """The tokenizer's EOS id plus the `eos_token_id`(s) of a model or generation config
    (an object with that attribute, or a dict), which may list several (e.g. Llama 3's
    <|eot_id|>)."""
    ids = _as_id_set(tokenizer.eos_token_id)
    if hf_config is not None:
        if isinstance(hf_config, Mapping):
            ids |= _as_id_set(hf_config.get("eos_token_id"))
        else:
            ids |= _as_id_set(getattr(hf_config, "eos_token_id", None))
    return ids
