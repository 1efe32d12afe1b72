"""core/outputs.py: sparse vectors keep the largest weight per id in id order and prune as configured, and MaxSim
is the sum over query tokens of their best match among the document's (issue 32)."""

from __future__ import annotations

import numpy as np

from inferd.core.outputs import SparseVector, TextOutputs, asked, maxsim, maxsim_scores, sparse_from_weights
from inferd.core.text_options import PLAIN, TextOptions


def test_the_largest_weight_per_id_in_id_order_zeros_dropped() -> None:
    v = sparse_from_weights([9, 4, 9, 7, 2], [0.5, 0.25, 1.5, 0.0, -1.0])
    assert v.indices.tolist() == [4, 9] and v.values.tolist() == [0.25, 1.5]
    assert len(sparse_from_weights([], [])) == 0


def test_pruning_keeps_the_largest_above_the_threshold_in_id_order() -> None:
    v = SparseVector(np.array([1, 3, 5, 8]), np.array([0.4, 0.9, 0.4, 0.1], dtype=np.float32), ("a", "b", "c", "d"))
    top = v.pruned(top_k=2)
    assert top.indices.tolist() == [1, 3] and top.tokens == ("a", "b")  # a tie at the k-th goes to the lower id
    assert v.pruned(threshold=0.4).indices.tolist() == [3]  # at the threshold is dropped
    assert v.pruned(top_k=1, threshold=0.05).indices.tolist() == [3]
    np.testing.assert_array_equal(v.dense(10)[[1, 3, 5, 8]], v.values)


def test_a_text_asks_by_its_outputs_in_a_fixed_order() -> None:
    assert asked(TextOptions(outputs=("multivector", "dense")), ("sparse",)) == ("dense", "multivector")
    assert asked(PLAIN, ("sparse",)) == ("sparse",)
    assert TextOutputs(sparse=sparse_from_weights([1], [1.0])).kinds == ("sparse",)


def test_maxsim_sums_each_query_token_s_best_match() -> None:
    query = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    doc_a = np.array([[1.0, 0.0], [0.6, 0.8]], dtype=np.float32)
    doc_b = np.array([[0.0, -1.0]], dtype=np.float32)
    assert abs(maxsim(query, doc_a) - 1.8) < 1e-6  # 1.0 from [1, 0], 0.8 from [0.6, 0.8]
    assert maxsim(query, doc_b) == -1.0  # a document of one token: each query token's only match
    np.testing.assert_allclose(maxsim_scores(query, [doc_a, doc_b, np.zeros((0, 2))]), [1.8, -1.0, 0.0], atol=1e-6)
