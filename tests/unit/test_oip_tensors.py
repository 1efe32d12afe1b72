"""api/oip_tensors.py against tritonclient's own encoding: the request bodies ``tritonclient.http`` builds (JSON and
binary tensors) read as the texts sent, and the answers written read back by tritonclient's ``InferResult`` as the
values given; a body that does not add up is refused with a message naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton

from inferd.api.oip_tensors import OIPError, OutputTensor, read_infer, write_infer

TEXTS = ["hello", "", "日本語のテキスト", "a" * 300]


def request(*inputs: triton.InferInput,
            outputs: list[triton.InferRequestedOutput] | None = None) -> tuple[bytes, str | None]:
    body, json_size = triton.InferenceServerClient.generate_request_body(list(inputs), outputs=outputs)
    return body, None if json_size is None else str(json_size)


def texts(name: str, values: list[str], binary: bool, shape: list[int] | None = None) -> triton.InferInput:
    tensor = triton.InferInput(name, shape or [len(values)], "BYTES")
    return tensor.set_data_from_numpy(np.array(values, dtype=object).reshape(shape or [len(values)]),
                                      binary_data=binary)


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclients_request_bodies_read_as_the_texts_sent(binary: bool) -> None:
    body = read_infer(*request(texts("query", ["q"], binary), texts("documents", TEXTS, binary, [2, 2])))
    assert body.inputs == {"query": ["q"], "documents": TEXTS}  # a [2, 2] tensor in row-major order
    assert body.outputs is None and body.binary_default  # none asked: every output, in binary
    asked = read_infer(*request(texts("text", TEXTS, binary), outputs=[
        triton.InferRequestedOutput("label", binary_data=False), triton.InferRequestedOutput("score")]))
    assert asked.outputs == {"label": False, "score": True}


def test_answers_read_back_by_tritonclient_as_the_values_given() -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    labels = ["positive", "négatif", ""]
    for binary in (True, False):
        content, header = write_infer({"model_name": "m", "model_version": "1"},
                                      [(OutputTensor("embedding", "FP32", vectors), binary),
                                       (OutputTensor("label", "BYTES", labels), binary)])
        assert (header is not None) == binary
        result = triton.InferResult.from_response_body(content, header_length=header)
        np.testing.assert_array_equal(result.as_numpy("embedding"), vectors)
        assert result.as_numpy("embedding").shape == (3, 4)
        got = result.as_numpy("label")
        assert [v.decode() if isinstance(v, bytes) else v for v in got] == labels


def test_a_body_that_does_not_add_up_is_refused_naming_the_tensor() -> None:
    body, size = request(texts("text", ["abc", "de"], True))
    assert size is not None
    cases = [
        (body[:-1], size, "past the end of the body"),  # the last element cut short
        (body + b"x", size, "bytes of binary tensors"),  # bytes no tensor names
        (body, str(len(body) + 1), "Inference-Header-Content-Length"),
        (body, "ten", "Inference-Header-Content-Length"),
        (b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [["a"], "b"]}]}', None,
         "shape [1] holds 1 elements; 2 were sent"),
        (b'{"inputs": [{"name": "text", "shape": [-1], "datatype": "BYTES", "data": ["a"]}]}', None, "shape must"),
        (b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}], "id": 5}', None,
         "id: must be a string"),
        (b'[1]', None, "must be a JSON object"),
    ]
    for raw, header, words in cases:
        with pytest.raises(OIPError) as caught:
            read_infer(raw, header)
        assert words in caught.value.message and caught.value.status == 400, (raw[:60], caught.value.message)


def test_a_deeply_nested_data_list_is_flattened_without_recursion() -> None:
    # orjson parses up to 1024 levels, past the interpreter's default recursion limit (1000).
    depth = 1020
    data = "[" * depth + '"x"' + "]" * depth
    raw = ('{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ' + data + "}]}").encode()
    assert read_infer(raw, None).inputs == {"text": ["x"]}
