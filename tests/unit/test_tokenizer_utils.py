"""Prompt encoding, chat templates and EOS ids, on the bundled SmolLM2 tokenizer and on a
word-level tokenizer built here (adds BOS, has no chat template)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from aioengine.tokenizer_utils import (ChatTemplateError, apply_chat_template, encode_prompt,
                                       get_eos_token_ids, render_chat_template)

SMOL_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n")


@pytest.fixture(scope="module")
def word_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", "hello", "world", "user", "says"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_encode_prompt_adds_what_the_tokenizer_adds(bundled_tokenizer, word_tokenizer):
    assert encode_prompt(bundled_tokenizer, "hello world") == [28120, 905]  # SmolLM2: no BOS
    assert encode_prompt(word_tokenizer, "hello world") == [1, 3, 4]
    assert encode_prompt(word_tokenizer, "") == [1]
    with pytest.raises(TypeError):
        encode_prompt(word_tokenizer, [3, 4])  # type: ignore[arg-type]


def test_chat_template_string_content(bundled_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = render_chat_template(bundled_tokenizer, messages)
    assert text == SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = apply_chat_template(bundled_tokenizer, messages)
    assert ids == bundled_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one token, not its spelling
    no_prompt = apply_chat_template(bundled_tokenizer, messages, add_generation_prompt=False)
    assert bundled_tokenizer.decode(no_prompt) == text.removesuffix("<|im_start|>assistant\n")


def test_chat_template_list_of_parts(bundled_tokenizer):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    assert apply_chat_template(bundled_tokenizer, parts) == \
        apply_chat_template(bundled_tokenizer, plain)
    assert render_chat_template(bundled_tokenizer, parts).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n")
    # An assistant turn with null content (OpenAI allows it) renders as empty.
    text = render_chat_template(bundled_tokenizer, plain + [{"role": "assistant", "content": None}],
                                add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<|im_end|>\n")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ({"role": "user", "content": "x"}, "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\] needs a non-empty string 'role'"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\] needs 'content'"),
    ([{"role": "user", "content": 3}], "must be a string or a list of parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\] has unsupported type 'image_url'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "needs a string 'text'"),
    ([{"role": "user", "content": ["x"]}], r"content\[0\] must be an object"),
])
def test_malformed_messages(bundled_tokenizer, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        apply_chat_template(bundled_tokenizer, messages)


def test_no_chat_template(word_tokenizer):
    assert issubclass(ChatTemplateError, ValueError)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(word_tokenizer, [{"role": "user", "content": "hello"}])


def test_template_errors_become_chat_template_errors(word_tokenizer):
    tok = word_tokenizer
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'user' %}"
                         "{{ raise_exception('only user turns') }}{% endif %}"
                         "{{ m['role'] + ' says ' + m['content'] + ' ' }}{% endfor %}")
    try:
        assert apply_chat_template(tok, [{"role": "user", "content": "hello world"}]) == [5, 6, 3, 4]
        with pytest.raises(ChatTemplateError, match="only user turns"):
            apply_chat_template(tok, [{"role": "system", "content": "hello"}])
    finally:
        tok.chat_template = None


def test_eos_token_ids(bundled_tokenizer, word_tokenizer):
    assert get_eos_token_ids(bundled_tokenizer) == {2}
    assert get_eos_token_ids(bundled_tokenizer, {"eos_token_id": [2, 0]}) == {0, 2}
    assert get_eos_token_ids(bundled_tokenizer, {"eos_token_id": None}) == {2}
    assert get_eos_token_ids(word_tokenizer, GenerationConfig(eos_token_id=[5, 6])) == {2, 5, 6}
    assert get_eos_token_ids(word_tokenizer, LlamaConfig(eos_token_id=4)) == {2, 4}
    no_eos = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer.backend_tokenizer)
    assert get_eos_token_ids(no_eos) == set()
