"""Prompt-side tokenizer helpers: plain prompts, chat templates, EOS ids, and the boundary
between a chat template's control tokens and the text of the messages (PromptBoundary)."""
from __future__ import annotations

import json
import re
import secrets
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import orjson
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


# Sentinels (content's special-token text while the template renders) and twins (the
# template's own special tokens while the split tokenizer encodes) are a per-process secret
# prefix of private-use characters plus one index character, so message text cannot spell
# them: Jinja passes them through untouched (strip/trim, tojson with ensure_ascii=False).
_SENTINEL_PLANE, _TWIN_PLANE = 0xF0000, 0x100000  # Supplementary Private Use Areas A and B
_SECRET_CHARS = 4


def _secret(plane: int) -> str:
    return "".join(chr(plane + secrets.randbelow(0xFFF0)) for _ in range(_SECRET_CHARS))


def _alternation(words: list[str]) -> str:
    """A regex matching `words` leftmost-longest, as the tokenizer's added-token matcher."""
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


class PromptBoundary:
    """Keeps special-token text that comes from messages (content, names, tool calls and
    results, tool definitions) plain text, while the chat template's own special tokens
    stay control tokens (transformers' and vLLM's `split_special_tokens` semantics, applied
    to the messages only).

    `escape` replaces the special-token text of a message string by sentinels before the
    template renders; every special token left in the rendered text is the template's.
    `encode` then swaps those for twins (non-special added tokens with the same matching
    flags) and the sentinels back to their text, encodes with a tokenizer that does not
    match special tokens (`encode_special_tokens`) but matches the twins, and maps twins
    to the special ids: one encode of the whole text, so the ids equal what the model's
    tokenizer gives wherever the messages hold no special-token text.
    Invariant: a special token id in `encode`'s output came from the template's text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        added = {i: a for i, a in getattr(tokenizer, "added_tokens_decoder", {}).items()
                 if getattr(a, "content", "")}
        self.special_ids = {a.content: i for i, a in added.items() if a.special}
        specials = list(self.special_ids)
        self._special_re = re.compile(_alternation(specials)) if specials else None
        self._json_spells_specials = all(orjson.dumps(c).decode() == f'"{c}"' for c in specials)
        sentinel, self._twin_prefix = _secret(_SENTINEL_PLANE), _secret(_TWIN_PLANE)
        self._sentinel = {c: sentinel + chr(_SENTINEL_PLANE + k) for k, c in enumerate(specials)}
        self._twin = {c: self._twin_prefix + chr(_TWIN_PLANE + k) for k, c in enumerate(specials)}
        # A sentinel and its JSON escape (json.dumps with ensure_ascii, as tool parsers and
        # some templates' tojson write it) -> the special-token text, written alike.
        self._unescape = {v: k for k, v in self._sentinel.items()}
        self._unescape.update({json.dumps(v)[1:-1]: json.dumps(k)[1:-1]
                               for k, v in self._sentinel.items()})
        # Sentinels, and every added token (non-special ones map to themselves, so a special
        # is replaced exactly where the tokenizer would have matched it).
        words = [*self._unescape, *{a.content for a in added.values()}]
        self._swap_re = re.compile(_alternation(words) or "(?!)")
        self._split: tuple[Any, dict[int, int]] | None = None
        self._lock = threading.Lock()

    def has_special(self, text: str) -> bool:
        return self._special_re is not None and self._special_re.search(text) is not None

    def escape(self, value: Any) -> Any:
        """`value` (a string, or lists and dicts of them, keys included) with special-token
        text replaced by sentinels; the very same object when there was none."""
        if self._special_re is None:
            return value
        if self._json_spells_specials and not isinstance(value, str):
            # One C serialization and one search instead of a Python walk of every string
            # (25,000 messages: ~4 ms instead of ~50); JSON writes special tokens as they
            # are (_json_spells_specials), so none in the JSON means none in any string.
            try:
                text = orjson.dumps(value).decode()
            except (TypeError, orjson.JSONEncodeError):  # not JSON (LLM.chat's callers)
                text = None
            if text is not None and not self.has_special(text):
                return value
        return self._escape(value)

    def _escape(self, value: Any) -> Any:
        if isinstance(value, str):
            if not self.has_special(value):
                return value
            assert self._special_re is not None
            return self._special_re.sub(lambda m: self._sentinel[m.group()], value)
        if isinstance(value, (list, tuple)):
            items = [self._escape(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, Mapping):
            pairs = [(self._escape(k), self._escape(v)) for k, v in value.items()]
            if all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(pairs, value.items())):
                return value
            return dict(pairs)
        return value

    def unescape(self, text: str) -> str:
        """`text` with sentinels back to the special-token text they stand for."""
        return self._swap_re.sub(lambda m: self._unescape.get(m.group(), m.group()), text)

    def _swap(self, match: re.Match) -> str:
        word = match.group()
        if word in self._unescape:
            return self._unescape[word]
        return self._twin.get(word, word)

    def encode(self, rendered: str, check_length: Callable[[int], None] | None = None
               ) -> list[int]:
        """Token ids of a prompt rendered from escaped messages (no special tokens added);
        `check_length(count)` is called with the token count first."""
        if self._twin_prefix in rendered:  # unreachable without the process's secret
            raise ChatTemplateError("the messages hold reserved private-use characters")
        split = self._split_tokenizer()
        if split is None:
            ids = self._encode_pieces(rendered)
            if check_length is not None:
                check_length(len(ids))
            return ids
        backend, twin_ids = split
        # The batch call releases the GIL (this runs on a prompt thread for large bodies).
        encoding = backend.encode_batch_fast([self._swap_re.sub(self._swap, rendered)],
                                             add_special_tokens=False)[0]
        if check_length is not None:
            check_length(len(encoding))
        return [twin_ids.get(i, i) for i in encoding.ids]

    def _split_tokenizer(self) -> tuple[Any, dict[int, int]] | None:
        with self._lock:
            if self._split is None:
                self._split = _split_tokenizer(self._tokenizer, self._twin,  # type: ignore
                                               self.special_ids)
            return self._split or None

    def _encode_pieces(self, rendered: str) -> list[int]:
        """For a tokenizer without a Rust backend: the text between the template's special
        tokens encoded piece by piece with `split_special_tokens` (as its slow tokenize
        splits at added tokens; lstrip/rstrip flags are not applied here)."""
        ids: list[int] = []
        pos = 0
        pieces = [] if self._special_re is None else list(self._special_re.finditer(rendered))
        for match in [*pieces, None]:
            end = match.start() if match is not None else len(rendered)
            text = self.unescape(rendered[pos:end])
            if text:
                ids += self._tokenizer.encode(text, add_special_tokens=False,
                                              split_special_tokens=True)
            if match is not None:
                ids.append(self.special_ids[match.group()])
                pos = match.end()
        return ids


def _split_tokenizer(tokenizer: Any, twins: dict[str, str], special_ids: dict[str, int]
                     ) -> tuple[Any, dict[int, int]] | tuple:
    """A Rust tokenizer encoding as the model's does with `encode_special_tokens` set, plus
    the twins as non-special added tokens; and the twins' ids -> the special ids. It shares
    the model's vocabulary and pipeline objects (built in well under a millisecond; a full
    copy of the bundled tokenizer takes ~0.2 s holding the GIL). () when the model's
    tokenizer has no backend, or one that truncates or pads."""
    from tokenizers import AddedToken, Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return ()
    added = sorted(backend.get_added_tokens_decoder().items())
    split = Tokenizer(backend.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        setattr(split, part, getattr(backend, part))
    for token_id, token in added:
        (split.add_special_tokens if token.special else split.add_tokens)([token])
        if split.token_to_id(token.content) != token_id:  # ids out of order: copy it all
            split = Tokenizer.from_str(backend.to_str())
            break
    split.encode_special_tokens = True
    flags = {t.content: t for _, t in added}
    twin_ids = {}
    for content, twin in twins.items():
        like = flags.get(content) or AddedToken(content, special=True)
        split.add_tokens([AddedToken(twin, single_word=like.single_word, lstrip=like.lstrip,
                                     rstrip=like.rstrip, normalized=like.normalized,
                                     special=False)])
        twin_ids[split.token_to_id(twin)] = special_ids[content]
    return split, twin_ids


_BOUNDARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BOUNDARIES_LOCK = threading.Lock()


def prompt_boundary(tokenizer: Any) -> PromptBoundary:
    """The tokenizer's PromptBoundary (one per tokenizer and size of its vocabulary)."""
    key = len(getattr(tokenizer, "added_tokens_decoder", {}))
    with _BOUNDARIES_LOCK:
        cached = _BOUNDARIES.get(tokenizer)
        if cached is None or cached[0] != key:
            cached = (key, PromptBoundary(tokenizer))
            _BOUNDARIES[tokenizer] = cached
        return cached[1]
