"""A request's encoding choices (core/text_options.py TextOptions and InputOptions, read by core/preprocess.py's
encoders), the model folder's prompts and Matryoshka sizes (core/tasks/embedding.py), and the size rule
(core/tasks/task.py wrong_dimensions): no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prompted import CARD
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel

from inferd.core.cache import cache_key
from inferd.core.description import ModelDescription
from inferd.core.errors import EngineError, ModelLoadError
from inferd.core.outputs import asked, is_query
from inferd.core.preprocess import InputError, TextEncoder, check_texts
from inferd.core.prompts import Prompt, prompt_text
from inferd.core.tasks.embedding import card_matryoshka, matryoshka
from inferd.core.tasks.st_folder import read_folder
from inferd.core.tasks.task import wrong_dimensions
from inferd.core.text_options import PLAIN, PLAIN_INPUTS, InputOptions, TextOptions

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "query:", "passage:"]
VOCAB = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}


def tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])])
    return tok


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


def options(**chosen: object) -> InputOptions:
    """One text's options, as a request's shared value."""
    return InputOptions(TextOptions(**chosen))  # type: ignore[arg-type]


TEXT = "one two three four five six seven eight"


def test_a_prompted_text_is_its_value_and_plain_texts_encode_as_before() -> None:
    encoder = TextEncoder(tokenizer(), 6, truncate=True)
    plain, prompted = encoder.encode(["one two", "query: one two"],
                                     InputOptions(each=(PLAIN, TextOptions(prompt="query: "))))
    assert plain.ids == [2, *ids("one two"), 3] and plain.skip == 0
    assert prompted.ids == [2, *ids("query: one two"), 3]
    assert encoder.encode(["one two"]) == encoder.encode(["one two"], PLAIN_INPUTS) == [plain]


def test_the_cache_key_tells_apart_what_can_change_a_vector() -> None:
    assert PLAIN.key_suffix == "" and TextOptions().key_suffix == ""  # no choices: a plain text's key
    keys = {"query: one two" + TextOptions(prompt="query: ").key_suffix, "query: one two",
            "one two" + TextOptions(direction="left").key_suffix, "one two" + TextOptions(truncate=False).key_suffix,
            "one two" + TextOptions(max_tokens=4).key_suffix, "one two",
            "one two" + TextOptions(outputs=("sparse",)).key_suffix,
            "one two" + TextOptions(outputs=("dense", "sparse")).key_suffix,
            "one two" + TextOptions(role="query").key_suffix}
    assert len(keys) == 9
    # A prompt added on the slot that runs the text keeps the outputs it asked (issue 32).
    asking = TextOptions(outputs=("sparse",)).chosen(None, "query: ")
    query = TextOptions(role="query").chosen(None, "query: ")
    assert query.role == "query" and query.prompt == "query: "
    assert asking.outputs == ("sparse",)
    assert asking.key_suffix != PLAIN.chosen(None, "query: ").key_suffix


def test_a_request_s_outputs_and_prompt_are_chosen_once_for_all_its_texts() -> None:
    """Issue 40: admission rebuilt every text (a str subclass) for the outputs asked and the prompt; now the
    request's one options value is chosen once, a route's own choices (its cut side, truncate, max_tokens, role)
    kept, and no text is rebuilt for it."""
    cut = InputOptions(TextOptions(direction="left", max_tokens=4, role="query"))
    chosen = cut.chosen(("dense", "sparse"), "q: ")
    assert chosen.each is None and chosen[0] is chosen[7]  # one value, whatever the count of texts
    assert (chosen[0].prompt, chosen[0].outputs) == ("q: ", ("dense", "sparse"))
    assert (chosen[0].direction, chosen[0].max_tokens, chosen[0].role) == ("left", 4, "query")
    assert PLAIN_INPUTS.chosen(None, "") is PLAIN_INPUTS and PLAIN_INPUTS.plain and not chosen.plain
    assert PLAIN_INPUTS.chosen(("sparse",), "")[0].outputs == ("sparse",)
    # One per text (a gRPC rerank stream's messages): each keeps its own, the request's choices added to each.
    each = InputOptions.of([PLAIN, TextOptions(direction="left"), PLAIN]).chosen(None, "q: ")
    assert [o.direction for o in each.per_text(3)] == ["right", "left", "right"]
    assert {o.prompt for o in each.per_text(3)} == {"q: "}
    assert InputOptions.of([PLAIN, TextOptions()]).each is None  # all alike: held as one shared value
    assert [o.direction for o in each.taking([1, 0]).per_text(2)] == ["left", "right"]


def test_a_text_s_choices_are_its_options_not_read_from_the_text() -> None:
    """Issue 40: the handlers read the outputs and role a text asks for from its options (a typed value beside
    the texts), never from the text: a text is a plain string, whatever attributes a subclass of it carries."""
    assert asked(TextOptions(outputs=("sparse", "dense")), ("dense",)) == ("dense", "sparse")
    assert asked(PLAIN, ("dense",)) == ("dense",) and not is_query(PLAIN)
    assert is_query(TextOptions(role="query")) and not is_query(TextOptions(role="document"))


def test_the_left_cut_is_the_tokenizers_own_and_keeps_the_prompt() -> None:
    encoder = TextEncoder(tokenizer(), 6, truncate=True)
    reference = tokenizer()
    reference.enable_truncation(6, direction="left")
    (left,) = encoder.encode([TEXT], options(direction="left"))
    assert left.ids == reference.encode(TEXT).ids == [2, *ids("five six seven eight"), 3] and left.truncated
    (prompted,) = encoder.encode(["query: " + TEXT], options(prompt="query: ", direction="left"))
    assert prompted.ids == [2, VOCAB["query:"], *ids("six seven eight"), 3]
    (short,) = encoder.encode(["query: one two"], options(prompt="query: ", direction="left"))
    assert short.ids == [2, *ids("query: one two"), 3] and not short.truncated
    (right,) = encoder.encode([TEXT], options(max_tokens=4))
    assert right.ids == [2, *ids("one two"), 3] and right.truncated


def test_truncate_per_text_overrides_the_model_setting() -> None:
    strict = TextEncoder(tokenizer(), 6, truncate=False)
    (cut,) = strict.encode([TEXT], options(truncate=True))
    assert cut.tokens == 6
    lenient = TextEncoder(tokenizer(), 6, truncate=True)
    with pytest.raises(InputError) as refused:
        lenient.encode(["one", TEXT], InputOptions(each=(PLAIN, TextOptions(truncate=False))))
    assert refused.value.index == 1 and refused.value.code == "context_length_exceeded"
    assert "model's limit of 6 tokens" in refused.value.message
    with pytest.raises(InputError, match="limit of 4 tokens asked"):
        lenient.encode([TEXT], options(truncate=False, max_tokens=4))


def test_a_prompt_left_out_of_pooling_counts_as_sentence_transformers_counts_it() -> None:
    encoder = TextEncoder(tokenizer(), 16, truncate=True, exclude_prompt=True)
    # [CLS] query: -> 2 tokens (the prompt alone is [CLS] query: [SEP], less the trailing special one).
    assert encoder.prompt_tokens("query: ") == 2
    fast, by_hand = encoder.encode(["query: one two", "query: one two"], InputOptions(each=(
        TextOptions(prompt="query: "), TextOptions(prompt="query: ", direction="left"))))
    assert fast.skip == by_hand.skip == 2 and fast.ids == by_hand.ids
    (plain,) = encoder.encode(["query: one two"])  # a text that merely starts like the prompt: all pooled
    assert plain.skip == 0


def test_the_text_limit_counts_the_client_s_text_not_the_model_s_prompt() -> None:
    # The request's texts are checked as the client sent them; the prompt is prepended later, on the model load
    # that runs them (core/admission.py), so it never counts against the limit.
    assert check_texts(["a" * 20_000], 8, 20_000) == ["a" * 20_000]
    with pytest.raises(InputError, match="is 20001 characters long; the limit is 20000"):
        check_texts(["a" * 20_001], 8, 20_000)


def test_prompts_and_the_default_prompt_are_read_from_the_folder(tmp_path: Path) -> None:
    def read(folder: Path) -> tuple[dict[str, str], str | None, bool]:
        f = read_folder(folder)
        return f.prompts, f.default_prompt_name, f.include_prompt

    assert read(tmp_path) == ({}, None, True)
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "empty": None}, "default_prompt_name": "query"}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Transformer", "path": ""},
        {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                    "include_prompt": False}))
    assert read(tmp_path) == ({"query": "query: ", "empty": ""}, "query", False)
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: "}, "default_prompt_name": "passage"}))
    with pytest.raises(ModelLoadError, match="passage"):
        read(tmp_path)


def test_matryoshka_sizes_come_from_the_setting_else_the_model_card(tmp_path: Path) -> None:
    assert card_matryoshka(tmp_path) is None and matryoshka(None, tmp_path, 32) is None
    (tmp_path / "README.md").write_text(CARD)
    assert card_matryoshka(tmp_path) == [8, 16, 32]
    assert matryoshka(None, tmp_path, 32) == [8, 16, 32]
    assert matryoshka([16, 4], tmp_path, 32) == [4, 16] and matryoshka("any", tmp_path, 32) == "any"
    assert matryoshka([], tmp_path, 32) is None  # an empty list turns the card's sizes off
    with pytest.raises(ModelLoadError, match="64"):
        matryoshka([64], tmp_path, 32)
    # A card that mentions matryoshka_dims but was not trained with the loss (no tag) declares nothing.
    (tmp_path / "README.md").write_text(CARD.replace("- loss:MatryoshkaLoss\n", ""))
    assert card_matryoshka(tmp_path) is None


def test_the_size_rule_allows_the_models_own_and_its_matryoshka_sizes() -> None:
    def described(matryoshka: tuple[int, ...] | str | None = None) -> ModelDescription:
        return ModelDescription("m", "v1", 1, "/m", "embedding", dimension=32, matryoshka_dimensions=matryoshka)

    assert wrong_dimensions(described(), 32) is None
    refused = wrong_dimensions(described(), 16)
    assert refused is not None and refused.field == "dimensions" and "no Matryoshka sizes" in refused.message
    listed = described((8, 16, 32))
    assert wrong_dimensions(listed, 16) is None
    refused = wrong_dimensions(listed, 12)
    assert refused is not None and "[8, 16]" in refused.message
    anything = described("any")
    assert wrong_dimensions(anything, 1) is None and wrong_dimensions(anything, 31) is None
    assert wrong_dimensions(anything, 33) is not None


def test_the_prompt_is_the_described_model_s_own() -> None:
    """core/prompts.py: a name, the default, Cohere's input type (by the operator's mapping, else the built-in
    names; an input type with no prompt gets none), and an unknown name refused under the request's field."""
    prompts = {"query": "query: ", "passage": "passage: "}
    d = ModelDescription("m", "v1", 1, "/m", "embedding", prompts=prompts, default_prompt_name="query")
    assert prompt_text(d, Prompt(), {}) == "query: " and prompt_text(d, Prompt("passage"), {}) == "passage: "
    assert prompt_text(d, Prompt(input_type="search_document"), {}) == "passage: "
    assert prompt_text(d, Prompt(input_type="clustering"), {}) == ""
    assert prompt_text(d, Prompt(input_type="clustering"), {"clustering": "query"}) == "query: "
    with pytest.raises(EngineError) as caught:
        prompt_text(d, Prompt(input_type="classification", field="input_type"), {"classification": "nope"})
    assert caught.value.field == "input_type" and 'Available prompts: ["passage","query"]' in caught.value.message
    assert prompt_text(ModelDescription("m", "v1", 1, "/m", "embedding"), Prompt(), {}) == ""


def test_a_text_holding_a_nul_is_never_keyed_as_another_text_with_other_options() -> None:
    """The options' suffix starts with a NUL: a text that ends in one (\\u0000 in JSON) must not take the key of
    the shorter text with those options, nor of itself with the default ones."""
    for options in (TextOptions(direction="left"), TextOptions(truncate=False), TextOptions(prompt="q: ")):
        assert cache_key("one two" + options.key_suffix, PLAIN) != cache_key("one two", options)
        pair = ("query", "one two")
        assert cache_key(("query", "one two" + options.key_suffix), PLAIN) != cache_key(pair, options)
    assert cache_key("one\x00", PLAIN) != cache_key("one", PLAIN)
    assert cache_key("one two", PLAIN) == "one two"  # a plain text without a NUL is still keyed as itself
