"""IncrementalDetokenizer: streaming text, incomplete characters, stop strings.

Runs on the bundled SmolLM2 tokenizer (byte-level BPE) and on tokenizers built here from a
few sentences (no downloads): SentencePiece-style BPE with byte fallback and Llama's
decoder, a Unigram model with a Metaspace decoder, and WordPiece.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from aioengine.detokenizer import IncrementalDetokenizer, make_decode_fn
from aioengine.sampling_params import SamplingParams

SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
             "END of the line. STOP here!", "café naïve résumé", "one two three four five"]
FFFD = "\ufffd"


def _sp_bytefallback() -> PreTrainedTokenizerFast:
    """Llama-style: BPE over Metaspace words, unknown characters as <0xXX> byte tokens,
    decoder Replace(▁→' ') + ByteFallback + Fuse + Strip(one leading space), BOS added."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40))
    spec = json.loads(tok.to_str())
    spec["model"]["byte_fallback"] = True
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _sp_unigram() -> PreTrainedTokenizerFast:
    """T5-style: Unigram with a Metaspace pre-tokenizer and decoder (no byte fallback)."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(SENTENCES, trainers.UnigramTrainer(
        vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _wordpiece() -> PreTrainedTokenizerFast:
    """BERT-style: its decoder puts a space between words, special tokens included."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


@pytest.fixture(scope="module")
def tokenizers_by_kind(bundled_tokenizer) -> dict[str, PreTrainedTokenizerFast]:
    return {"bytelevel": bundled_tokenizer, "sp_bytefallback": _sp_bytefallback(),
            "sp_unigram": _sp_unigram(), "wordpiece": _wordpiece()}


@pytest.fixture(scope="module")
def sp_tokenizer(tokenizers_by_kind) -> PreTrainedTokenizerFast:
    return tokenizers_by_kind["sp_bytefallback"]


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, batches: list[list[int]], prompt: list[int] | None = None,
           **params) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feeds `batches` through update(); returns the deltas (last one: at finish)."""
    detok = IncrementalDetokenizer(tokenizer, prompt or [], SamplingParams(**params))
    deltas, stop = [], None
    for batch in batches:
        stop = detok.update(batch, False)
        if stop is not None:
            break
        deltas.append(detok.get_next_output_text(False, delta=True))
    deltas.append(detok.get_next_output_text(True, delta=True))
    return deltas, detok, stop


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    batches, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        batches.append(ids[i:i + size])
        i += size
    if i < len(ids):
        batches.append(ids[i:])
    return batches


PIECES = ["a", "b", " ", "hello", " world", "é", "ñ", "café", "世", "界", "😀", "🎉", " END",
          "EN", "D", "\n", ".", " the", "ü"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["bytelevel", "sp_bytefallback", "sp_unigram", "wordpiece"]),
       pieces=st.lists(st.one_of(st.sampled_from(PIECES), st.integers(0, 2)), max_size=25),
       sizes=st.lists(st.integers(1, 4), max_size=40),
       prompt_text=st.sampled_from([None, "", "Hi there", "x 😀"]),
       skip=st.booleans())
def test_deltas_concatenate_to_decode(tokenizers_by_kind, kind, pieces, sizes, prompt_text, skip):
    """For any split into update() batches: every prefix of the stream is a prefix of the
    final text (nothing is taken back, no character is split, no U+FFFD of a partial
    character goes out), and the deltas add up to what the tokens append to the prompt."""
    tok = tokenizers_by_kind[kind]
    # Pieces are encoded one by one, so special tokens (ints) fall between characters.
    ids = [t for p in pieces for t in ([p] if isinstance(p, int) else enc(tok, p))]
    prompt = [] if prompt_text is None else tok.encode(prompt_text)
    decode = make_decode_fn(tok, skip)
    expected = decode(prompt + ids)[len(decode(prompt)):]
    if not prompt or kind == "bytelevel":
        assert expected == tok.decode(ids, skip_special_tokens=skip)
    deltas, detok, _ = stream(tok, split(ids, sizes), prompt, skip_special_tokens=skip)
    emitted = ""
    for delta in deltas[:-1]:
        emitted += delta
        assert expected.startswith(emitted) and FFFD not in delta
    assert "".join(deltas) == expected == detok.output_text
    assert detok.output_token_ids == ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["bytelevel", "sp_bytefallback"]),
       pieces=st.lists(st.sampled_from(PIECES), max_size=25),
       sizes=st.lists(st.integers(1, 4), max_size=40),
       stops=st.lists(st.sampled_from(["END", "lo w", "\n\n", "é", "D.", "世界", "ab"]),
                      min_size=1, max_size=3),
       include=st.booleans())
def test_stop_strings_any_split(tokenizers_by_kind, kind, pieces, sizes, stops, include):
    """The stream stops at the stop string a character-by-character reader of decode()
    meets first, whatever the batches, and never streams text it later takes back."""
    tok = tokenizers_by_kind[kind]
    ids = [t for p in pieces for t in enc(tok, p)]
    full = tok.decode(ids)
    # (end, start, stop) of each stop string's first occurrence; the least one wins.
    hits = sorted((full.find(s) + len(s), full.find(s), s) for s in stops if s in full)
    expected = full if not hits else full[:hits[0][0] if include else hits[0][1]]
    deltas, detok, stop = stream(tok, split(ids, sizes), stop=stops,
                                 include_stop_str_in_output=include)
    assert stop == (hits[0][2] if hits else None)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)
    assert emitted == expected == detok.output_text


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=40), sizes=st.lists(st.integers(1, 5)),
       skip=st.booleans())
def test_random_token_ids_bytelevel(bundled_tokenizer, ids, sizes, skip):
    """Arbitrary tokens, invalid UTF-8 included: the stream still adds up to decode()."""
    deltas, _, _ = stream(bundled_tokenizer, split(ids, sizes), skip_special_tokens=skip)
    expected = bundled_tokenizer.decode(ids, skip_special_tokens=skip)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)
    assert emitted == expected


def test_multibyte_characters_are_held_until_complete(bundled_tokenizer, sp_tokenizer):
    tok = bundled_tokenizer
    # "😀" is 3 byte-level tokens, "世界" 5 (2 + 3).
    assert stream(tok, [[t] for t in enc(tok, "😀")])[0] == ["", "", "😀", ""]
    assert stream(tok, [[t] for t in enc(tok, "世界")])[0] == ["", "世", "", "", "界", ""]
    # " 😀" starts with token "Ġð\x9f\x98": the space is stable at once, the emoji is not.
    assert stream(tok, [[t] for t in enc(tok, "a 😀")])[0] == ["a", " ", "😀", ""]
    # SentencePiece byte fallback: one <0xXX> token per byte.
    ids = enc(sp_tokenizer, "a世")
    assert sp_tokenizer.convert_ids_to_tokens(ids)[-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]
    assert stream(sp_tokenizer, [[t] for t in ids])[0][-4:] == ["", "", "世", ""]


def test_incomplete_character_released_at_finish(bundled_tokenizer):
    ids = enc(bundled_tokenizer, "ok 😀")[:-1]
    deltas, detok, _ = stream(bundled_tokenizer, [ids])
    assert deltas == ["ok ", FFFD] and detok.output_text == "ok " + FFFD
    assert "".join(deltas) == bundled_tokenizer.decode(ids)


def test_decode_cost_does_not_grow_with_output(bundled_tokenizer):
    tok = bundled_tokenizer
    detok = IncrementalDetokenizer(tok, enc(tok, "Count:"), SamplingParams())
    decode, window_sizes = detok._decode, []

    def counting_decode(ids: list[int]) -> str:
        window_sizes.append(len(ids))
        return decode(ids)

    detok._decode = counting_decode
    ids = enc(tok, " 😀 one two, 世界 three." * 100)
    for t in ids:
        detok.update([t], False)
    assert detok.output_text == tok.decode(ids)
    assert max(window_sizes) <= 20 and len(window_sizes) < 1.25 * len(ids)


def test_sentencepiece_first_token_keeps_space_after_prompt(sp_tokenizer):
    ids = enc(sp_tokenizer, "hello world")
    assert sp_tokenizer.convert_ids_to_tokens(ids)[0] == "▁hello"
    assert "".join(stream(sp_tokenizer, [ids])[0]) == "hello world"  # no prompt: as decode()
    prompt = sp_tokenizer.encode("the fox")
    assert "".join(stream(sp_tokenizer, [ids], prompt)[0]) == " hello world"
    # The prompt's text is empty (BOS only): the first space goes, as decode() does it.
    assert "".join(stream(sp_tokenizer, [ids], sp_tokenizer.encode(""))[0]) == "hello world"


def test_stop_string_across_token_boundary(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = enc(tok, "the") + enc(tok, " E") + enc(tok, "ND") + enc(tok, " more")
    deltas, detok, stop = stream(tok, [[t] for t in ids], stop=["END"])
    assert stop == "END" and detok.stop_string == "END"
    assert deltas == ["the", " ", ""] and detok.output_text == "the "
    # The token completing the stop string is the last one taken.
    assert detok.output_token_ids == ids[:3]
    assert detok.update(enc(tok, " again"), False) is None and detok.output_token_ids == ids[:3]


def test_holdback_is_exactly_longest_stop_prefix(bundled_tokenizer):
    tok = bundled_tokenizer
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END", "ENORMOUS"]))
    detok.update(enc(tok, "the EN"), False)
    assert detok.get_next_output_text(False, delta=True) == "the "  # "EN" may become a stop
    detok.update(enc(tok, "O"), False)
    assert detok.get_next_output_text(False, delta=True) == ""  # "ENO" still may
    detok.update(enc(tok, "x"), False)
    assert detok.get_next_output_text(False, delta=True) == "ENOx"
    detok.update(enc(tok, " E"), False)
    assert detok.get_next_output_text(False, delta=False) == "the ENOx "
    assert detok.get_next_output_text(True, delta=True) == "E"  # finished: all released
    assert detok.output_text == "the ENOx E"


@pytest.mark.parametrize("include, text", [(False, "the "), (True, "the END")])
def test_include_stop_str_in_output(bundled_tokenizer, include, text):
    tok = bundled_tokenizer
    deltas, detok, stop = stream(tok, [enc(tok, "the END of it")], stop=["END"],
                                 include_stop_str_in_output=include)
    assert stop == "END" and "".join(deltas) == detok.output_text == text


@pytest.mark.parametrize("stops", [["world", "lo w"], ["lo w", "world"]])
def test_earliest_stop_string_wins(bundled_tokenizer, stops):
    tok = bundled_tokenizer
    _, detok, stop = stream(tok, [enc(tok, "hello world")], stop=stops)
    assert stop == "lo w" and detok.output_text == "hel"
    # Same end: the one starting first wins.
    _, detok, stop = stream(tok, [enc(tok, "hello world")], stop=["d", "orld"],
                            include_stop_str_in_output=True)
    assert stop == "orld" and detok.output_text == "hello world"


def test_stop_string_in_batch_ignores_later_tokens(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = enc(tok, "one two three four")
    _, detok, stop = stream(tok, [ids], stop=["two"])
    assert stop == "two" and detok.output_text == "one "
    assert detok.output_token_ids == enc(tok, "one two")


def test_min_tokens_delays_stop_strings(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = enc(tok, "a. b. c.")
    assert len(ids) == 6
    _, detok, stop = stream(tok, [[t] for t in ids], stop=["."], min_tokens=2)
    assert stop == "." and detok.output_text == "a. b"


@pytest.mark.parametrize("include, skip, text", [
    (False, True, "hi"), (False, False, "hi"), (True, True, "hi"), (True, False, "hi<|im_end|>")])
def test_stop_token_text(bundled_tokenizer, include, skip, text):
    """vLLM: the stop token's text shows only with include_stop_str_in_output (and then
    only if it is not a skipped special token)."""
    tok = bundled_tokenizer
    ids = enc(tok, "hi") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(
        include_stop_str_in_output=include, skip_special_tokens=skip))
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.get_next_output_text(True, delta=False) == text
    assert detok.output_token_ids == ids


def test_non_special_stop_token(bundled_tokenizer):
    tok = bundled_tokenizer
    ids = enc(tok, "a b.")
    for include, text in [(False, "a b"), (True, "a b.")]:
        detok = IncrementalDetokenizer(tok, [], SamplingParams(include_stop_str_in_output=include))
        detok.update(ids, stop_terminated=True)
        assert detok.get_next_output_text(True, delta=True) == text


@pytest.mark.parametrize("skip, text", [
    (True, "hello world"), (False, "<|im_start|>hello<|im_end|><|im_end|> world")])
def test_skip_special_tokens(bundled_tokenizer, skip, text):
    tok = bundled_tokenizer
    ids = [1] + enc(tok, "hello") + [2, 2] + enc(tok, " world")
    deltas, _, _ = stream(tok, [[t] for t in ids], skip_special_tokens=skip)
    assert "".join(deltas) == text


@pytest.mark.parametrize("spaces, text", [
    (True, "[CLS] hello [SEP] [SEP] world"), (False, "[CLS] hello [SEP][SEP] world")])
def test_spaces_between_special_tokens(tokenizers_by_kind, spaces, text):
    tok = tokenizers_by_kind["wordpiece"]
    ids = [1] + enc(tok, "hello") + [2, 2] + enc(tok, "world")
    deltas, _, _ = stream(tok, [[t] for t in ids], skip_special_tokens=False,
                          spaces_between_special_tokens=spaces)
    assert "".join(deltas) == text
    deltas, _, _ = stream(tok, [ids], skip_special_tokens=True,
                          spaces_between_special_tokens=spaces)
    assert "".join(deltas) == "hello world"


def test_transformers_decode_path_matches_backend(tokenizers_by_kind):
    for tok in tokenizers_by_kind.values():
        ids = enc(tok, "hello world, café 世界 😀 the END.") + [1, 2]
        for skip in (True, False):
            fast, slow = make_decode_fn(tok, skip), make_decode_fn(tok, skip, use_backend=False)
            assert fast(ids) == slow(ids) == tok.decode(ids, skip_special_tokens=skip)
