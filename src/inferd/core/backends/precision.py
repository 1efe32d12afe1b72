"""Mixed precision on OpenVINO (``model.dtype: mixed``): bf16 where rounding only rounds, float32 where a float
becomes an index and where two rounded activations meet before a softmax.

OpenVINO's CPU plugin runs a whole graph in bf16 when asked, the small arithmetic around the matrix products
included. Some encoders compute integers through floats: MPNet's relative-position buckets are
``log(distance / 8) / log(128 / 8) * 16``, truncated to an integer, then an index into the position-bias table.
In bf16 (8 bits of mantissa) that quotient lands on the wrong side of an integer for some distances, so a text's
tokens read another bucket's bias: not a rounding of the answer but another position encoding.
all-mpnet-base-v2 in bf16 falls to cosine min 0.9958 against torch fp32 on the gate's texts (the half bound is
0.9995); every matrix product rounded to bf16 as the plugin does, in torch, gives 0.99993 on the same texts, and
the attention kept in float32 in OpenVINO changes nothing (0.99586): the loss is the index arithmetic
(docs/backends.md, "A base-size model on bf16").

The recipe: every floating-point operation whose value reaches a conversion to an integer type is kept in float32
(the plugin's ``precise`` runtime attribute, which it honours for the operations it lowers to bf16); the matrix
products and everything else run in bf16. Which operations those are is read from the graph, not from
names, so any model's index arithmetic is found. The attribute is set in the IR text before the graph is read,
as the IR reader turns it into the runtime attribute the plugin checks (a value set from Python is a string the
plugin cannot read), after OpenVINO's own simplifications (``simplified``); ``kept`` reads back which operations
carry it.

Measured in process on all-mpnet-base-v2 (2-core Xeon with AMX, 80 of the gate's texts, against OpenVINO float32):
bf16 cosine min 0.995839, mixed 0.999823 (mean 0.9999757), the matrix products and attention in bf16 in both
(bench/mpnet_mixed.py).

The attention products are kept too: on a 2-core AMD EPYC with avx512_bf16 and no AMX, the index arithmetic alone
left one of the gate's 256 texts (58 tokens) at cosine 0.99733 and the gate refused mixed; keeping every other
operation but the matrix products in float32 as well changed nothing (0.99659), the attention's two products of
activations (query x key, weights x value) in float32 gave 0.99979 (the server's gate: cosine min 0.9997897,
overlap@10 0.991), at the same speed in process (17.1-17.9 texts/s against 17.7-18.5, batches of 32; float32
9.5-10.4). They are found by shape, as the index arithmetic is: a MatMul neither of whose inputs is a weight. The
plugin fuses each attention into one operation (the two products, the scaling, the bias and the softmax) and runs it
in float32; the projections and the feed-forward products stay bf16.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# The IR's name of OpenVINO's DisableFP16Compression ("precise"), and the key its reader files it under.
ATTRIBUTE = '<attribute name="precise" version="0" />'
RT_KEY = "DisablePrecisionConversion_0"
_FLOATS = ("f32", "f16", "bf16")
# Operations that pass a value on without computing from it (a weight seen through them is still a weight).
_MOVES = ("Convert", "Reshape", "Transpose", "Unsqueeze", "Squeeze")
_LAYER = re.compile(r'(<layer id="\d+" name="([^"]*)" type="[^"]*" version="[^"]*">)')


def _float(output: Any) -> bool:
    return output.get_element_type().get_type_name() in _FLOATS


def index_arithmetic(graph: Any) -> set[str]:
    """The friendly names of the floating-point operations whose value becomes an integer: each conversion from a
    float to an integer type, and every float-valued operation that feeds it (constants aside: their values are
    what they are)."""
    found: set[str] = set()
    stack = [op for op in graph.get_ops() if op.get_type_name() == "Convert" and not _float(op.output(0))
             and _float(op.input_value(0))]
    seen: set[int] = set()
    while stack:
        op = stack.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        found.add(op.get_friendly_name())
        for value in op.input_values():
            parent = value.get_node()
            if _float(value) and parent.get_type_name() not in ("Constant", "Parameter"):
                stack.append(parent)
    return found


def mark(xml: str, names: set[str]) -> str:
    """The IR text with the named layers kept in float32."""

    def keep(match: re.Match[str]) -> str:
        if match.group(2) not in names:
            return match.group(1)
        return f"{match.group(1)}\n\t\t\t<rt_info>\n\t\t\t\t{ATTRIBUTE}\n\t\t\t</rt_info>"

    return _LAYER.sub(keep, xml)


def simplified(core: Any, graph_path: Path, work: Path) -> Path:
    """The graph after OpenVINO's own simplifications (constant folding, fusing a product of constants, a division
    by a constant turned into a product), saved in ``work``. The plugin applies them at compile time and the
    operations they make do not inherit the float32 mark (OpenVINO does not copy it to a replacement): marking the
    graph as the plugin will see it is what keeps the marks: MPNet's bucket quotient and product run in bf16 when
    marked before the simplifications, float32 when marked after (tests/integration/test_mixed_precision.py reads
    what the compiled graph runs the kept operations in)."""
    import openvino as ov
    from openvino._offline_transformations import apply_moc_transformations

    graph = core.read_model(str(graph_path))
    apply_moc_transformations(graph, cf=True)
    out = work / "simplified.xml"
    ov.save_model(graph, str(out), compress_to_fp16=False)
    return out


def _computed(value: Any) -> bool:
    """Whether a value is computed from the inputs, not a weight: a Constant seen through the operations that only
    move or convert it (a transposed or dequantised weight is still a weight)."""
    node = value.get_node()
    while node.get_type_name() in _MOVES:
        node = node.input_value(0).get_node()
    return node.get_type_name() != "Constant"


def attention_products(graph: Any) -> set[str]:
    """The friendly names of the matrix products of two computed values (attention's query x key and weights x
    value), as against a value times a weight: both factors rounded to bf16 and the product fed to a softmax."""
    return {op.get_friendly_name() for op in graph.get_ops()
            if op.get_type_name() == "MatMul" and all(_computed(v) for v in op.input_values())}


def marked(graph_path: Path, graph: Any) -> tuple[str, set[str]]:
    """The IR text of ``graph_path`` (``graph`` is the same IR, read) with its index arithmetic and its attention
    products kept in float32, and the names kept; the caller reads it with the weights beside it."""
    names = index_arithmetic(graph) | attention_products(graph)
    return mark(graph_path.read_text(), names), names


def kept(graph: Any) -> set[str]:
    """The operations of a graph (read, or a compiled model's runtime graph) that carry the attribute."""
    return {op.get_friendly_name() for op in graph.get_ops() if RT_KEY in op.get_rt_info()}
