"""ColBERT token vectors (issue 32) on a tiny random PyLate-layout folder: queries carry the query marker and are
expanded with mask tokens the text does not attend to, documents carry theirs and drop punctuation; every vector is
the Dense projection of the token state, normalised. The handler's vectors and MaxSim scores equal a direct
computation on the bare transformers model, written out below."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from inferd.core.errors import ModelLoadError
from inferd.core.loading import load_handler
from inferd.core.outputs import maxsim, maxsim_scores
from inferd.core.preprocess import InputError
from inferd.core.spec import ModelSpec
from inferd.core.tasks.late_rerank import LateInteractionRerankHandler
from inferd.core.tasks.multivector import ColbertHandler
from inferd.core.text_options import PLAIN, PLAIN_INPUTS, InputOptions, TextOptions
from tests.tinymodel import write_tiny_colbert

QUERY_LENGTH, DOCUMENT_LENGTH, DIM = 12, 24, 16
QUERIES = ["cat and dog", "the river in the city, the mountain!"]
DOCUMENTS = ["the cat and the dog run.", "a river runs in the city, by the mountain; yes!", "hello",
             " ".join(["model"] * 40)]


# A text marked a query, as a late-interaction request marks it (api/inferd_encode.py, tasks/late_rerank.py).
QUERY = TextOptions(role="query")


def queries_then(documents: list[str]) -> InputOptions:
    """The options of QUERIES followed by ``documents``."""
    return InputOptions(each=(QUERY,) * len(QUERIES) + (PLAIN,) * len(documents))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PyLate's layout (tests/tinymodel.py write_tiny_colbert, which the wire tests serve too)."""
    return write_tiny_colbert(tmp_path_factory.mktemp("colbert") / "colbert", seed=7, dim=DIM,
                              query_length=QUERY_LENGTH, document_length=DOCUMENT_LENGTH)


@pytest.fixture(scope="module")
def reference(folder: Path) -> tuple[Any, Any, torch.Tensor]:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertModel

    return (AutoTokenizer.from_pretrained(folder), BertModel.from_pretrained(folder).eval(),
            load_file(str(folder / "1_Dense" / "model.safetensors"))["linear.weight"])


def _direct(reference: tuple[Any, Any, torch.Tensor], text: str, query: bool) -> np.ndarray:
    """The vectors as PyLate computes them, for one text alone."""
    tokenizer, model, weight = reference
    length = QUERY_LENGTH if query else DOCUMENT_LENGTH
    ids = tokenizer(text, truncation=True, max_length=length - 1)["input_ids"]
    ids = ids[:1] + [tokenizer.convert_tokens_to_ids("[Q] " if query else "[D] ")] + ids[1:]
    mask = [1] * len(ids)
    if query:
        pad = QUERY_LENGTH - len(ids)
        ids, mask = ids + [tokenizer.mask_token_id] * pad, mask + [0] * pad
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([mask])).last_hidden_state[0]
        vectors = torch.nn.functional.normalize(hidden @ weight.T, dim=-1).numpy()
    if query:
        return vectors
    skip = {tokenizer.convert_tokens_to_ids(w) for w in (",", ".", "!", ";")}
    return vectors[[i for i, t in enumerate(ids) if t not in skip]]


@pytest.fixture(scope="module")
def handler(folder: Path) -> Any:
    handler = load_handler(ModelSpec(folder, "1", device="cpu", warmup=False))
    assert type(handler) is ColbertHandler  # a PyLate folder is told by its modules
    return handler


def _vectors(handler: Any, texts: list[Any], options: InputOptions = PLAIN_INPUTS) -> list[np.ndarray]:
    return [o.multivector for o in handler.postprocess(handler.infer(handler.preprocess(texts, options)))]


def test_queries_and_documents_equal_the_direct_computation(reference: Any, handler: Any) -> None:
    texts, options = [*QUERIES, *DOCUMENTS], queries_then(DOCUMENTS)
    got = _vectors(handler, texts, options)  # queries and documents of every length in one batch
    for text, chosen, vectors in zip(texts, options.per_text(len(texts)), got, strict=True):
        want = _direct(reference, text, chosen.role == "query")
        assert vectors.shape == want.shape
        np.testing.assert_allclose(vectors, want, atol=1e-5, rtol=0)
    assert got[0].shape == (QUERY_LENGTH, DIM)  # expanded to the query length
    assert got[-1].shape == (DOCUMENT_LENGTH, DIM)  # cut to the document length, markers included
    assert handler.loaded.facts.other["multivector_dimension"] == DIM


def test_maxsim_rerank_equals_the_direct_computation(reference: Any, handler: Any) -> None:
    query = _vectors(handler, [QUERIES[1]], InputOptions(QUERY))[0]
    documents = _vectors(handler, DOCUMENTS)
    want_q = _direct(reference, QUERIES[1], True)
    want = [float((want_q @ _direct(reference, doc, False).T).max(axis=1).sum()) for doc in DOCUMENTS]
    np.testing.assert_allclose(maxsim_scores(query, documents), want, atol=1e-4, rtol=0)
    assert int(np.argmax(want)) == 1  # the document sharing the query's words ranks first
    assert maxsim(query, documents[1]) == pytest.approx(want[1], abs=1e-4)


def test_a_dense_output_is_refused_and_a_marker_missing_from_the_tokenizer_is_named(folder: Path, handler: Any,
                                                                                      tmp_path: Path) -> None:
    with pytest.raises(InputError, match="asks for dense; this model gives multivector only"):
        handler.preprocess(["hello"], InputOptions(TextOptions(outputs=("dense",))))
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    cfg = json.loads((other / "config_sentence_transformers.json").read_text())
    cfg["query_prefix"] = "[QUERY] "
    (other / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="query marker '\\[QUERY\\] ' is not a token"):
        ColbertHandler().load(ModelSpec(other, "1", device="cpu", warmup=False), torch.device("cpu"))


def test_the_projection_runs_inside_the_exported_graph_behind_the_gate(folder: Path, handler: Any,
                                                                       tmp_path: Path) -> None:
    # ONNX Runtime: 6 s here against OpenVINO's 30 s; bge-m3's ColBERT head takes the same tokens head through
    # OpenVINO in test_sparse.py.
    converted = load_handler(ModelSpec(folder, "1", device="cpu", warmup=False, backend="onnx",
                                       cache_dir=str(tmp_path), gate={"texts": 32}))
    figures = converted.loaded.backend_info["gate"]["figures"]
    assert figures["maxsim_spearman"] == 1.0 and figures["maxsim_top3"] == 1.0 and figures["sparse_top10"] is None
    texts, options = [QUERIES[0], *DOCUMENTS], InputOptions(each=(QUERY,) + (PLAIN,) * len(DOCUMENTS))
    for want, got in zip(_vectors(handler, texts, options), _vectors(converted, texts, options), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_late_interaction_reranker_cuts_each_document_as_its_request_chose(folder: Path, handler: Any) -> None:
    reranker = load_handler(ModelSpec(folder, "1", device="cpu", warmup=False, task="rerank"))
    try:
        assert isinstance(reranker, LateInteractionRerankHandler)
        long = " ".join([DOCUMENTS[0]] * 3 + [DOCUMENTS[1]] * 3)  # longer than the document length, its ends unlike
        (right, left, plain) = reranker.preprocess([(QUERIES[0], long)] * 3, InputOptions(each=(
            TextOptions(direction="right"), TextOptions(direction="left"), PLAIN)))
        ask = ("multivector",)
        want_left, want_right = handler.encode_texts([long, long], InputOptions(each=(
            TextOptions(direction="left", outputs=ask), TextOptions(outputs=ask))))
        assert (left.ids, right.ids, plain.ids) == (want_left.ids, want_right.ids, want_right.ids)
        assert left.ids != right.ids  # the side is the document's own choice, not the model's default
        with pytest.raises(InputError):  # truncate: false refuses the text rather than cut it
            reranker.preprocess([(QUERIES[0], long)], InputOptions(TextOptions(truncate=False)))
        assert reranker.loaded.facts.other == {"scoring": "maxsim", "multivector_dimension": DIM}
    finally:
        reranker.close()
