"""Input checks and tokenisation, with a tokenizer built in memory: no model weights, no files."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel

from inferd.core.preprocess import InputError, TextEncoder, check_texts

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
