"""Routing keys for prefix-cache affinity: chained hashes of a prompt's leading blocks.

The ingress has the request body but no tokenizer, so a prompt's blocks are bytes of its
UTF-8 text (or token ids, when a completion prompt is given as ids): block i's hash is
`xxh3_64(block_i, seed=hash_{i-1})`, as the KV cache chains its block hashes, and only
full blocks count (a replica caches only full KV blocks). Two prompts share the first k
hashes exactly when they share their first k blocks, so the router can look for the
longest leading run it has already sent somewhere.
"""
from __future__ import annotations

from array import array
from typing import Any

import xxhash

DEFAULT_BLOCK_CHARS = 256
# A token id block is this many times smaller than a character block (~4 characters per
# token in English text with a BPE vocabulary).
CHARS_PER_TOKEN = 4
DEFAULT_MAX_BLOCKS = 32


def prompt_text(body: dict[str, Any]) -> str | list[int] | None:
    """What the engine will see first of a request body, as text or token ids: the
    completion prompt (the first of a batch), the chat messages or the Responses input
    (each turn as `role\\ncontent\\n`). None when there is nothing to route by."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_turn_text(m) for m in messages)
    if "input" in body:  # the Responses API
        text = body.get("instructions") if isinstance(body.get("instructions"), str) else ""
        items = body["input"]
        if isinstance(items, str):
            return text + items
        if isinstance(items, list):
            return text + "".join(_turn_text(m) for m in items)
    return None


def _turn_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    role = message.get("role")
    return f"{role if isinstance(role, str) else ''}\n{_content_text(message.get('content'))}\n"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_hashes(prompt: str | list[int] | None, block_chars: int = DEFAULT_BLOCK_CHARS,
                  max_blocks: int = DEFAULT_MAX_BLOCKS, salt: str = "") -> tuple[int, ...]:
    """The chained hashes of the prompt's full leading blocks (at most `max_blocks`). A
    LoRA adapter's name as `salt` starts the chain elsewhere: the KV cache keeps each
    adapter's blocks apart, so the same prompt on another adapter shares nothing."""
    if not prompt or block_chars < 1:
        return ()
    if isinstance(prompt, str):
        data, block = prompt.encode("utf-8", "surrogatepass"), block_chars
    else:
        try:
            ids = array("q", prompt)
        except OverflowError:  # not token ids the engine accepts: it answers the 400
            return ()
        data, block = ids.tobytes(), max(1, block_chars // CHARS_PER_TOKEN) * ids.itemsize
    hashes: list[int] = []
    parent = xxhash.xxh3_64_intdigest(salt.encode("utf-8", "surrogatepass")) if salt else 0
    for start in range(0, min(len(data) // block, max_blocks) * block, block):
        parent = xxhash.xxh3_64_intdigest(data[start:start + block], seed=parent)
        hashes.append(parent)
    return tuple(hashes)
