"""core/chunking.split with the tiny model's tokenizer: spans slice the original text exactly (Chinese, emoji,
accents), no piece over budget, counts as the tokenizer counts the piece alone, paragraph boundaries kept,
overlap shares tokens, and the handler's truncating tokenizer is neither obeyed nor changed; a request's chunking
options checked before any model; and how pieces' outputs merge into a document's (core/tasks/piece_merge.py)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
from tinymodel import CJK, WORDS
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from inferd.core.chunking import Chunking, Piece, split
from inferd.core.errors import EngineError, Kind
from inferd.core.outputs import SparseVector, TextOutputs
from inferd.core.tasks.embedding_task import DENSE, MULTIVECTOR, SPARSE, TOKEN_STATES
from inferd.core.tasks.piece_merge import merge, mergeable


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok.enable_truncation(16)  # as a handler's: truncating to its window
    return tok


def document(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(paragraphs):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(3)]
        sentences.append("".join(rng.choice(CJK) for _ in range(rng.randint(4, 20))) + "。🙂")
        sentences.append("café naïve 👩‍👩‍👧 ok!")
        out.append(" ".join(sentences))
    return "\n\n".join(out)


def count(tokenizer: Tokenizer, text: str) -> int:
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_truncation()
    return len(plain.encode(text, add_special_tokens=False).ids)


def test_spans_slice_the_text_exactly_and_fit(tokenizer: Tokenizer) -> None:
    text = document(0, 60)
    pieces = split(text, tokenizer, max_tokens=40)
    assert len(pieces) > 10
    for piece in pieces:
        assert 0 < piece.tokens <= 40
        assert piece.tokens == count(tokenizer, text[piece.start:piece.end])
        assert text[piece.start:piece.end] == text[piece.start:piece.end].strip()
    starts = [p.start for p in pieces]
    assert starts == sorted(starts)
    # Without overlap, the pieces and the whitespace between them make up the whole text.
    gaps = [text[a.end:b.start] for a, b in itertools.pairwise(pieces)]
    assert all(g.isspace() or g == "" for g in gaps)
    assert text[:pieces[0].start].strip() == "" and text[pieces[-1].end:].strip() == ""
    # The tokenizer the handler holds still truncates: the splitter worked on its own copy.
    assert len(tokenizer.encode(text).ids) == 16


def test_paragraphs_are_kept_whole_where_they_fit(tokenizer: Tokenizer) -> None:
    paragraphs = [" ".join(WORDS[i:i + 8]) + "." for i in range(0, 80, 8)]  # 9 tokens each
    text = "\n\n".join(paragraphs)
    pieces = split(text, tokenizer, max_tokens=20)
    # Two paragraphs fit a piece, three do not: every cut falls between paragraphs, never inside one.
    assert [text[p.start:p.end] for p in pieces] == ["\n\n".join(paragraphs[i:i + 2]) for i in range(0, 10, 2)]


def test_overlap_shares_tokens_between_neighbours(tokenizer: Tokenizer) -> None:
    text = " ".join(WORDS[5:50] * 6)
    pieces = split(text, tokenizer, max_tokens=30, overlap=8)
    assert len(pieces) > 3
    assert all(b.start < a.end for a, b in itertools.pairwise(pieces))
    assert all(p.tokens <= 30 for p in pieces)
    assert [text[p.start:p.end] for p in split(text, tokenizer, max_tokens=30)] != [text[p.start:p.end] for p in pieces]


def test_hf_fast_tokenizer_counts_like_its_backend(tiny_model: Path, tokenizer: Tokenizer) -> None:
    text = document(1, 10)
    fast = AutoTokenizer.from_pretrained(str(tiny_model))
    assert split(text, fast, max_tokens=25) == split(text, tokenizer, max_tokens=25)


def test_blank_text_has_no_pieces(tokenizer: Tokenizer) -> None:
    assert split("", tokenizer, max_tokens=10) == []
    assert split(" \n\t ", tokenizer, max_tokens=10) == []
    assert split("  hello  ", tokenizer, max_tokens=10) == [Piece(2, 7, 1)]


@pytest.mark.parametrize(("chunking", "field"), [
    (Chunking("sentences"), "chunking.mode"),
    (Chunking(max_tokens=0), "chunking.max_tokens"),
    (Chunking(overlap=-1), "chunking.overlap"),
    (Chunking(max_tokens=8, overlap=8), "chunking.overlap"),
])
def test_model_free_rules_name_the_field(chunking: Chunking, field: str) -> None:
    with pytest.raises(EngineError) as refused:
        chunking.check()
    assert refused.value.field == field and refused.value.kind is Kind.INVALID_INPUT


def test_pieces_merge_dense_by_tokens_sparse_by_max_and_token_vectors_in_order() -> None:
    a, b = np.array([1.0, 0.0], dtype=np.float32), np.array([0.0, 1.0], dtype=np.float32)
    np.testing.assert_allclose(merge([a, b], [3, 1], unit=False), [0.75, 0.25])
    np.testing.assert_allclose(merge([a, b], [3, 1], unit=True), np.array([3.0, 1.0]) / np.sqrt(10), rtol=1e-6)
    first = TextOutputs(dense=a, sparse=SparseVector(np.array([2, 5]), np.array([0.5, 0.1], dtype=np.float32),
                                                     ("x", "y")),
                        multivector=np.ones((2, 2), dtype=np.float32))
    second = TextOutputs(dense=b, sparse=SparseVector(np.array([5, 9]), np.array([0.4, 0.2], dtype=np.float32),
                                                      ("y", "z")),
                         multivector=np.zeros((3, 2), dtype=np.float32))
    merged = merge([first, second], [1, 1], unit=True)
    assert merged.sparse.indices.tolist() == [2, 5, 9] and merged.sparse.tokens == ("x", "y", "z")
    np.testing.assert_allclose(merged.sparse.values, [0.5, 0.4, 0.2])
    np.testing.assert_allclose(merged.multivector, np.concatenate([first.multivector, second.multivector]))
    np.testing.assert_allclose(merged.dense, np.array([1.0, 1.0]) / np.sqrt(2), rtol=1e-6)
    # A text that asked only some outputs merges only those.
    only = merge([TextOutputs(sparse=first.sparse), TextOutputs(sparse=second.sparse)], [1, 1], unit=True)
    assert only.kinds == ("sparse",)


def test_token_states_do_not_merge_so_a_model_s_default_leaves_them_whole() -> None:
    assert mergeable((DENSE.name, SPARSE.name, MULTIVECTOR.name))
    assert not mergeable((TOKEN_STATES.name,)) and not mergeable((DENSE.name, TOKEN_STATES.name))
