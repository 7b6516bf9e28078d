"""LayoutCanonicalizationPass: one spelling for the moves of data between axes.

Exporters spell one transpose several ways; the fusions that follow read one. Each rule below is exact
(it computes the same tensor), checked on the inferred (symbolic) shapes, never on names:

- `Transpose(Transpose(x, p), q)` → `Transpose(x, p∘q)`, or x when the composition is the identity.
- `Reshape(x, [-1, *x.shape[-k:]]) → Transpose(p) → Reshape(lead + permuted)`, a transpose of the last
  k axes written on a 3-D view (PyTorch's dynamo exporter writes `kᵀ` of a 4-D key this way), → one
  `Transpose` of x.
- `Reshape(x)` to the shape x already has (every dim known, symbolically equal) → x.
- `Transpose(0, 2, 3, 1)` of [B, S, H, D] keys into the scores' MatMul → the head split, then kᵀ; a head
  split followed by kᵀ is never composed back.
- `Reshape(Softmax(Flatten(x, axis=rank-1)), Shape(x))` (onnx's version converter's opset-12 Softmax) →
  `Softmax(x, axis=-1)`.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import bypass_node, tidy
from cann_llm.passes.pattern import producer, sole_consumer
from cann_llm.passes.shape_values import is_dim, reshape_target


def _known(shape) -> bool:
    return shape is not None and all(isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")) for d in shape)


def _perm(node: gs.Node) -> list[int] | None:
    perm = node.attrs.get("perm")
    return list(perm) if perm is not None else None


HEADS, KEYS_T, HEADS_KEYS_T = [0, 2, 1, 3], [0, 1, 3, 2], [0, 2, 3, 1]


def compose_transposes(graph: gs.Graph, node: gs.Node) -> bool:
    """Transpose of a Transpose → one Transpose (or none). A head split followed by kᵀ stays two: that
    is the canonical spelling of the keys (see split_key_transpose)."""
    inner = producer(node.inputs[0], "Transpose")
    outer_perm = _perm(node)
    if inner is None or outer_perm is None or _perm(inner) is None or len(inner.outputs[0].outputs) != 1:
        return False
    perm = [_perm(inner)[axis] for axis in outer_perm]
    source = inner.inputs[0]
    if perm == list(range(len(perm))):
        return bypass_node(graph, node, source)
    if (_perm(inner), outer_perm) == (HEADS, KEYS_T):
        return False
    node.inputs[0] = source
    node.attrs["perm"] = perm
    return True


def _keeps(reshape: gs.Node, dims: list[tuple[gs.Tensor, int] | None]) -> bool:
    """Whether Reshape's output dims are `dims` (pairs (tensor, axis); None: anything), read from its target
    or, where the target cannot be read, from the inferred shapes."""
    target = reshape_target(reshape)
    result = reshape.outputs[0].shape
    if target is not None and len(target) == len(dims):
        return all(want is None or is_dim(element, *want) for element, want in zip(target, dims))
    return _known(result) and len(result) == len(dims) and all(
        want is None or want[0].shape[want[1]] == dim for dim, want in zip(result, dims))


def merge_viewed_transpose(graph: gs.Graph, node: gs.Node) -> bool:
    """Reshape → Transpose → Reshape that only swaps trailing axes of the first Reshape's input → Transpose."""
    perm = _perm(node)
    before = producer(node.inputs[0], "Reshape")
    after = sole_consumer(graph, node.outputs[0], "Reshape")
    if perm is None or before is None or after is None or perm[0] != 0 or len(before.outputs[0].outputs) != 1:
        return False
    source, result = before.inputs[0], after.outputs[0]
    trailing = len(perm) - 1
    if source.shape is None or len(source.shape) <= trailing:
        return False
    lead = len(source.shape) - trailing
    if not _keeps(before, [None] + [(source, axis) for axis in range(lead, len(source.shape))]):
        return False  # the view does not keep the trailing axes whole
    moved = [lead + axis - 1 for axis in perm[1:]]
    if not _keeps(after, [(source, axis) for axis in range(lead)] + [(source, axis) for axis in moved]):
        return False
    after.outputs.clear()
    graph.nodes.append(gs.Node("Transpose", name=f"{node.name}/Canonical", attrs={"perm": list(range(lead)) + moved},
                               inputs=[source], outputs=[result]))
    return True


def drop_same_shape_reshape(graph: gs.Graph, node: gs.Node) -> bool:
    """A Reshape whose output has its input's shape, dim for dim."""
    source, result = node.inputs[0], node.outputs[0]
    if not _known(source.shape) or not _known(result.shape) or list(source.shape) != list(result.shape):
        return False
    return bypass_node(graph, node, source)


def split_key_transpose(graph: gs.Graph, node: gs.Node) -> bool:
    """Transpose(0, 2, 3, 1) of [B, S, H, D] keys that a MatMul multiplies from the right (kᵀ taken straight
    from the head split, as GPT-2's exports write it) → the head split (0, 2, 1, 3), then kᵀ (0, 1, 3, 2)."""
    if _perm(node) != HEADS_KEYS_T:
        return False
    reader = node.outputs[0]
    while True:  # through the scalar factors of a split scale
        consumer = sole_consumer(graph, reader, "Mul", "Div", "MatMul")
        if consumer is None:
            return False
        if consumer.op == "MatMul":
            break
        reader = consumer.outputs[0]
    if consumer.inputs[1] is not reader:
        return False
    source = node.inputs[0]
    if source.shape is not None and len(source.shape) != len(HEADS):
        return False  # a 4-d permutation of a tensor of another rank: the model is invalid, onnxruntime says so
    heads = gs.Variable(f"{node.name}/heads", dtype=source.dtype,
                        shape=None if source.shape is None else [source.shape[i] for i in HEADS])
    graph.nodes.append(gs.Node("Transpose", name=f"{node.name}/Heads", attrs={"perm": HEADS}, inputs=[source],
                               outputs=[heads]))
    node.inputs[0] = heads
    node.attrs["perm"] = KEYS_T
    return True


def unflatten_softmax(graph: gs.Graph, node: gs.Node) -> bool:
    """`Reshape(Softmax(Flatten(x, axis=rank-1)), Shape(x))` → `Softmax(x, axis=-1)`: onnx's version converter
    writes an opset-12 Softmax on the last axis so; the same values."""
    flatten = producer(node.inputs[0], "Flatten")
    readers = node.outputs[0].outputs
    if flatten is None or len(readers) != 1 or readers[0].op != "Reshape" or node.attrs.get("axis", -1) not in (-1, 1):
        return False
    x, reshape = flatten.inputs[0], readers[0]
    shape = producer(reshape.inputs[1], "Shape")
    if x.shape is None or flatten.attrs.get("axis", 1) != len(x.shape) - 1 or shape is None or shape.inputs[0] is not x \
            or shape.attrs.get("start", 0) != 0 or shape.attrs.get("end") is not None:
        return False
    result = reshape.outputs[0]
    reshape.outputs.clear()
    node.inputs[0] = x
    node.attrs["axis"] = -1
    node.outputs[0] = result
    return True


RULES = (("Transpose", split_key_transpose), ("Transpose", compose_transposes), ("Transpose", merge_viewed_transpose),
         ("Reshape", drop_same_shape_reshape), ("Softmax", unflatten_softmax))


class CanonicalizeLayout:
    """Apply the layout rules until none applies."""

    name = "LayoutCanonicalizationPass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        changed = True
        while changed:
            changed = False
            for op, rule in RULES:
                for node in [n for n in graph.nodes if n.op == op]:
                    if not node.outputs or not any(node in t.inputs for t in node.outputs):
                        continue  # already replaced in this round
                    if rule(graph, node):
                        result.match_times += 1
                        result.effect_times += 1
                        changed = True
            tidy(graph)
        return result
