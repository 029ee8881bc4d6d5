"""Streaming detokenization of one sample, with stop strings.

Text is decoded through a sliding window of token ids (vLLM's prefix/read offsets):

    ids:   [ ... prompt context ... | ... output tokens ... ]
                 ^prefix_offset                         end^
    decode(ids[prefix_offset:end]) = "already accounted text" + "new text"

Decoding a window rather than each token alone keeps what a tokenizer does at the start
of a string (SentencePiece's Strip/Metaspace drop the first leading space, WordPiece adds
no space before its first word) away from the new tokens; decoding a bounded window
rather than everything keeps the cost per token independent of the output length.

Invariants (tested):
- For any split of the output tokens into `update()` batches, the concatenated deltas of
  `get_next_output_text(..., delta=True)` equal
  `decode(ctx + out)[len(decode(ctx)):]`, ctx being the last prompt tokens; for byte-level
  BPE, or an empty prompt, that is `decode(out, skip_special_tokens=...)`. With a prompt,
  a SentencePiece-style first token keeps its leading space, as in the prompt's own text.
- Until finished, no delta ends in a U+FFFD that stands for an incomplete UTF-8 byte
  sequence, and none holds text that may still turn into a stop string.
- Text is decoded with `clean_up_tokenization_spaces=False` (as vLLM does): that clean-up
  rewrites text across token boundaries and so cannot stream.

Known limit: a ByteFallback decoder (Llama-style SentencePiece) renders a whole run of
<0xXX> byte tokens as U+FFFDs once the run holds an invalid UTF-8 sequence, which can
rewrite a character already streamed; only invalid byte output from the model hits it.
"""
from __future__ import annotations

from typing import Callable

from transformers import PreTrainedTokenizerBase

from aioengine.sampling_params import SamplingParams
from aioengine.stop_strings import StopStringCursor, stop_string_matcher

# Prompt tokens decoded as context in front of the first output token (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
# The window is moved forward once it holds more tokens than this.
_MAX_WINDOW_TOKENS = 16
# A character is at most 4 UTF-8 bytes and every token carries at least one byte, so a
# trailing U+FFFD that survives this many tokens is a real one (or an invalid sequence
# the model produced), not a character still being completed: release it.
_MAX_PENDING_TOKENS = 4
_REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[list[int]], str]


def make_decode_fn(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool,
                   use_backend: bool = True) -> DecodeFn:
    """ids -> text, as `tokenizer.decode(ids, skip_special_tokens, clean_up...=False)`.

    A fast tokenizer's Rust backend is called directly (about 5x cheaper than going through
    transformers; same text, since transformers only adds the clean-up we turn off).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if use_backend else None
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Per-sample streaming detokenizer (one per sample of a request).

    `update()` takes the sample's new token ids each step and returns the stop string if
    one now appears in the text; `get_next_output_text()` returns what may be streamed.

    Stop tokens (`stop_terminated=True`, vLLM semantics): the last token of that update is
    the EOS / stop_token_ids token that ended the sample. Its text is left out, unless
    `include_stop_str_in_output`, in which case it is decoded like any token (so it shows
    only if it is not special, or `skip_special_tokens=False`). It is always counted in
    `output_token_ids`.

    `spaces_between_special_tokens=False` (vLLM semantics for fast tokenizers): an added
    token right after another added token contributes exactly its content, without a
    space the tokenizer's decoder would put between them. True leaves `decode()`'s text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.stop: list[str] = list(params.stop or [])
        # One automaton for all stop strings (shared by the samples with this list), built
        # here once: each step then costs O(new characters), however many stop strings.
        self._stop_cursor = StopStringCursor(stop_string_matcher(self.stop)) \
            if self.stop else None
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._decode = make_decode_fn(tokenizer, params.skip_special_tokens)
        # Added token id -> content, only when spaces between them must be suppressed.
        self._added_tokens: dict[int, str] = {}
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added_tokens = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}

        self._token_ids: list[int] = []  # output tokens, stop token included
        self._ids = self._prompt_context(prompt_token_ids)  # context + decoded output
        self._prefix_offset = 0
        # Characters of decode(ids[prefix_offset:]) already turned into output (or context).
        self._consumed = len(self._decode(self._ids))
        self._clean_offset = len(self._ids)  # all ids before it are fully decoded
        self._prev_clean_offset = 0

        self._text = ""  # stable output text: no incomplete character at its end
        self._tail = ""  # U+FFFD(s) of an incomplete character after _text
        self._num_emitted = 0  # chars of _text handed out by get_next_output_text
        self._stop_search_from = 0  # a stop string must end after this char of _text
        self._stop_str: str | None = None
        self._finished = False

    # ---- public API ---------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All text so far, truncated at a stop string; excludes an incomplete trailing
        character until the sample is finished."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens taken so far (read-only): tokens after the one that completed a
        stop string, and all tokens after finishing, are ignored."""
        return self._token_ids

    @property
    def stop_string(self) -> str | None:
        return self._stop_str

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Appends new tokens (one or more per step). Returns the stop string if one now
        occurs in the text (the text is truncated before it, or after it with
        include_stop_str_in_output); tokens after it are ignored."""
        if self._stop_str is not None or self._finished or not new_token_ids:
            return None
        skipped_stop_token = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            fed = len(self._text)
            self._text += self._decode_next(token_id)
            if len(self._token_ids) <= self.min_tokens:
                # vLLM's min_tokens: no stop string may end inside the first min_tokens.
                self._stop_search_from = len(self._text)
            if self._stop_cursor is not None and self._check_stop(fed):
                return self._stop_str
        if skipped_stop_token is not None:
            self._token_ids.append(skipped_stop_token)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream now: new text since the last call (delta) or all text so far.

        Unless finished (or stopped), holds back an incomplete character and the longest
        suffix that is a proper prefix of a stop string. finished=True releases all.
        """
        if finished and not self._finished:
            self._finished = True
            if self._stop_str is None:
                self._text += self._tail
            self._tail = ""
        end = len(self._text)
        if not finished and self._stop_str is None and self._stop_cursor is not None:
            # The cursor has seen all of _text; what it holds never reaches into text
            # already emitted (that was held back then if it could still become a stop).
            end -= min(self._stop_cursor.partial_len, end - self._num_emitted)
        start = self._num_emitted
        # Never take back text already handed out (the hold-back never covers it anyway).
        self._num_emitted = max(end, start)
        return self._text[start:end] if delta else self._text[:self._num_emitted]

    # ---- internals ----------------------------------------------------------------------

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The last prompt tokens, enough to decode to some text (skipped special tokens
        decode to nothing), so the first output token is decoded as it follows the prompt.
        A prompt cut inside a character gets no context: the output cannot be separated
        from the prompt's text there."""
        n = min(_PROMPT_CONTEXT_TOKENS, len(prompt_token_ids))
        text = self._decode(prompt_token_ids[len(prompt_token_ids) - n:])
        while not text and n < min(len(prompt_token_ids), 8 * _PROMPT_CONTEXT_TOKENS):
            n = min(n + _PROMPT_CONTEXT_TOKENS, len(prompt_token_ids))
            text = self._decode(prompt_token_ids[len(prompt_token_ids) - n:])
        if text.endswith(_REPLACEMENT_CHAR):
            return []
        return list(prompt_token_ids[len(prompt_token_ids) - n:])

    def _decode_next(self, token_id: int) -> str:
        """Decodes one more token; returns the text it makes stable."""
        self._ids.append(token_id)
        full = self._decode(self._ids[self._prefix_offset:])
        stable_end = len(full)
        pending = len(self._ids) - self._clean_offset
        if full.endswith(_REPLACEMENT_CHAR) and pending < _MAX_PENDING_TOKENS:
            # An incomplete character decodes as trailing U+FFFD(s): wait for its bytes.
            stable_end = max(self._consumed, len(full.rstrip(_REPLACEMENT_CHAR)))
        # Decoding is prefix-stable (full[:consumed] is unchanged) for byte-level BPE,
        # SentencePiece and WordPiece decoders; any text beyond `consumed` is new.
        new_text = full[self._consumed:stable_end]
        self._consumed = stable_end
        self._tail = full[stable_end:]
        if self._added_tokens and token_id in self._added_tokens and \
                len(self._ids) >= 2 and self._ids[-2] in self._added_tokens:
            new_text = self._added_tokens[token_id]
        if stable_end == len(full):
            self._prev_clean_offset, self._clean_offset = self._clean_offset, len(self._ids)
            if len(self._ids) - self._prefix_offset > _MAX_WINDOW_TOKENS:
                self._slide_window()
        return new_text

    def _slide_window(self) -> None:
        """Starts the window at the previous clean point (a character boundary, text fully
        accounted). Only if that window decodes to some text: otherwise the decoder would
        treat the next token as the start of a string (e.g. drop its leading space)."""
        start = self._prev_clean_offset
        if start <= self._prefix_offset:
            return
        text = self._decode(self._ids[start:])
        if not text:
            return
        self._prefix_offset = start
        self._consumed = len(text)

    def _check_stop(self, fed: int) -> bool:
        """Feeds the text added since character `fed` (_text only ever grows until a stop:
        _decode_next returns only final characters, an incomplete one waits in _tail) and
        truncates at the first stop string ending after _stop_search_from, if any."""
        found = self._stop_cursor.feed(self._text, fed, self._stop_search_from)
        self._stop_search_from = len(self._text)
        if found is None:
            return False
        self._stop_str, end = found
        self._text = self._text[:end if self.include_stop_str_in_output
                                else end - len(self._stop_str)]
        self._tail = ""
        return True
