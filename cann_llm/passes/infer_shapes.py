"""ShapeInferencePass: give every intermediate value its dtype and (symbolic) shape.

Two inferences run: onnx's (data propagation on, strict off), then onnxruntime's symbolic one, which
follows Shape → Gather → Concat → Reshape chains with sympy. TorchScript exports compute every reshape
target at run time that way, and onnx's inference leaves their results as fresh unknown dims; the
symbolic one names them `batch`, `seq`, `past_seq + seq`, so a matcher can tell that two values have the
same shape. The symbolic result is taken where it fixes more dims than onnx's; when it cannot run (an op
it does not know), onnx's result stands alone. Neither knows this project's `MatMulInt4`, and onnx's does not
know onnxruntime's `MatMulNBits`: both run with each of them as a MatMul by a [K, N] stand-in, so what follows
has its shapes too (GLM's gate/up halves are cut at bounds computed from a MatMulNBits' output). A hybrid's
GatedDeltaNet and CausalConvWithState stand in as Identities of the inputs their outputs are shaped as.

Both serialise the model, and a protobuf cannot exceed 2 GiB, so they run on a light copy
(`light_model`) in which large weights are graph inputs of the same type and shape.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import threading
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import light_model

log = logging.getLogger("atc")
_LOADING = threading.Lock()


def _dims(value: onnx.ValueInfoProto) -> list | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]


def _symbolic_shape_inference() -> type:
    """onnxruntime's SymbolicShapeInference class. Importing it the usual way runs `onnxruntime.tools`'s
    `__init__`, which imports torch whenever torch is installed (1.3 s and ~185 MB for every compile, of a
    library the compiler never calls); the module itself needs only onnx, numpy and sympy, so unless some
    import has loaded it already it is loaded from its file (and, in a layout without that file, imported)."""
    name = "onnxruntime.tools.symbolic_shape_infer"
    with _LOADING:  # compiles in threads of one process: none may see a half-run module
        if name not in sys.modules:
            import onnxruntime

            path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
            if not path.is_file():
                from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

                return SymbolicShapeInference
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    return sys.modules[name].SymbolicShapeInference


def _symbolic(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """onnxruntime's symbolic inference, as far as it gets; nothing when it refuses the graph.

    Its `infer_shapes` entry point saves the model into the working directory (`sym_shape_infer_temp.onnx`
    and a data file) whenever some value stays unknown, then raises; its loop is run here instead, so a
    partial result is kept and nothing is written.
    """
    symbolic_shape_inference = _symbolic_shape_inference()  # outside the try: a missing module is no refusal
    try:
        inference = symbolic_shape_inference(2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
        inference._preprocess(model)
        inference.suggested_merge_.update(_one_past_length(model))
        while inference.run_:
            inference._infer_impl()
        inference._update_output_from_vi()
    except Exception as error:  # noqa: BLE001 - any refusal leaves onnx's shapes, which are complete enough to go on
        log.debug("ShapeInferencePass: symbolic inference skipped: %s", str(error).splitlines()[0] if str(error) else error)
        return {}
    inferred = inference.out_mp_
    found = {v.name: v for v in inferred.graph.value_info}
    found.update({v.name: v for v in inferred.graph.output})
    _rename_dims(found.values(), _first_declared_names(model, inference.suggested_merge_))
    return found


_NAME = re.compile(r"[A-Za-z_]\w*")


def _first_declared_names(model: onnx.ModelProto, merges: dict) -> dict[str, str]:
    """{merged name: name to give it} for dims the symbolic inference merged: each group of plain names is
    named after its member the graph's inputs declare first.

    Which name a merge keeps is the first of a Python set of names the inference iterates, an order that
    changes with the process's string-hash seed: a prefill-only export's values came out `[batch, seq, 64]`
    in one compile and `[batch, total, 64]` in the next, and so did the artifact's bytes."""
    declared = [d.dim_param for v in model.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param]
    rank = {name: index for index, name in reversed(list(enumerate(declared)))}
    groups: dict[str, set[str]] = {}
    for name, kept in merges.items():
        if isinstance(kept, str):
            groups.setdefault(kept, {kept}).add(name)
    renamed = {}
    for names in groups.values():
        if not all(map(_NAME.fullmatch, names)):
            continue  # an expression pasted into another would need its brackets: left as inferred
        first = min(names, key=lambda name: (rank.get(name, len(rank)), name))
        renamed.update({name: first for name in names if name != first})
    return renamed


def _rename_dims(values, renamed: dict[str, str]) -> None:
    """Each dim name (alone or in an expression such as `total + 1`) of `values` in `renamed`, renamed."""
    if not renamed:
        return
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, renamed)) + r")(?![\w.])")
    for value in values:
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_param = pattern.sub(lambda match: renamed[match.group(1)], dim.dim_param)


class InferShapes:
    """Annotate tensors with onnx's shape inference, refined by onnxruntime's symbolic one."""

    name = "ShapeInferencePass"
    switchable = False

    def run(self, graph: gs.Graph) -> PassResult:
        # both inferences compute the values of shape tensors (a Range over the sequence, say) element by
        # element: past PROPAGATED_DIM a fixed input dim would take them gigabytes, so only shapes are inferred
        propagate = _largest_input_dim(graph) <= PROPAGATED_DIM
        inferred = onnx.shape_inference.infer_shapes(_with_stand_ins(light_model(graph)[0]), data_prop=propagate)
        found = {v.name: v for v in inferred.graph.value_info}
        found.update({v.name: v for v in inferred.graph.output})
        symbolic = (_symbolic(inferred) if propagate and _symbolic_can_add(graph, found) and not _has_custom_ops(inferred)
                    else {})
        result = PassResult()
        # the graph's signature is what the exporter declared; inference may only fill what it left open
        declared = {id(t) for t in list(graph.inputs) + list(graph.outputs) if t.shape is not None}
        for name, tensor in graph.tensors().items():
            # past an op onnx's inference does not know (onnxruntime's SimplifiedLayerNormalization, which
            # its optimizer writes in the default domain) only the symbolic inference has a value
            value = found.get(name) or symbolic.get(name)
            if isinstance(tensor, gs.Constant) or value is None or not value.type.HasField("tensor_type"):
                continue
            result.match_times += 1
            elem_type = value.type.tensor_type.elem_type
            before = (tensor.dtype, tensor.shape)
            if elem_type:
                tensor.dtype = helper.tensor_dtype_to_np_dtype(elem_type)
            if id(tensor) in declared:
                result.effect_times += int(tensor.dtype != before[0])
                continue
            dims = _dims(value)
            better = symbolic.get(name)
            if better is not None and better.type.HasField("tensor_type"):
                refined = _dims(better)
                if refined is not None and (dims is None or _more_static(refined, dims) or _fewer_unknowns(refined, dims)):
                    dims = refined
            if dims is not None and (tensor.shape is None or _more_static(dims, tensor.shape)
                                     or _fewer_unknowns(dims, tensor.shape)):
                tensor.shape = dims
            if (tensor.dtype, tensor.shape) != before:
                result.effect_times += 1
        return result


_QUANTIZED_MATMULS = ("MatMulNBits", "MatMulInt4")
# onnxruntime's recurrent ops: each output shaped as an input (the result as the values, the state as the state)
_SHAPED_AS_INPUTS = {"GatedDeltaNet": (2, 6), "CausalConvWithState": (0, 3), "VarlenCausalConvWithState": (0, 4)}
PROPAGATED_DIM = 1 << 20  # a fixed input dim above which values are not propagated (a million tokens)


def _largest_input_dim(graph: gs.Graph) -> int:
    return max((dim for tensor in graph.inputs for dim in tensor.shape or () if isinstance(dim, int)), default=0)


def _with_stand_ins(model: onnx.ModelProto) -> onnx.ModelProto:
    """The module docstring's stand-ins, in place: each quantized matmul of `model` (a light copy) becomes a
    MatMul of A by a float32 [K, N] input of its own, which both inferences know; each of onnxruntime's
    recurrent ops (which onnx's inference does not know) Identities of the inputs its outputs are shaped as."""
    for node in [n for n in model.graph.node if n.op_type in _SHAPED_AS_INPUTS and n.domain == "com.microsoft"]:
        sources = [node.input[i] if i < len(node.input) else "" for i in _SHAPED_AS_INPUTS[node.op_type]]
        copies = [helper.make_node("Identity", [source], [output], name=f"{node.name}/stand_in_{i}")
                  for i, (source, output) in enumerate(zip(sources, node.output)) if source and output]
        index = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        for offset, copy in enumerate(copies):
            model.graph.node.insert(index + offset, copy)
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type not in _QUANTIZED_MATMULS or "K" not in attrs or "N" not in attrs:
            continue
        stand_in = f"{node.output[0]}__weight_stand_in"
        model.graph.input.append(helper.make_tensor_value_info(stand_in, onnx.TensorProto.FLOAT,
                                                               [attrs["K"].i, attrs["N"].i]))
        a = node.input[0]
        del node.input[:], node.attribute[:]
        node.input.extend([a, stand_in])
        node.op_type, node.domain = "MatMul", ""
    return model


def _one_past_length(model: onnx.ModelProto) -> dict[str, str]:
    """Each layer's past-length symbol merged into the first layer's, when the export named them apart.

    torch.export names every `past_key_values.N.*` sequence axis with a symbol of its own; the symbolic
    inference learns they are equal one layer at a time, restarting from the first node after each
    (SmolLM2: 30 restarts, 6 s; given the merges up front, one run of 0.3 s with the same shapes up to the
    name of the merged symbol). The runtime feeds every layer the same past length, so they are one dim."""
    names = []
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith("past_key_values.") and len(dims) == 4:
            if not dims[2].dim_param:
                return {}
            names.append(dims[2].dim_param)
    return {name: names[0] for name in names[1:] if name != names[0]}


def _symbolic_can_add(graph: gs.Graph, found: dict[str, onnx.ValueInfoProto]) -> bool:
    """Whether some value is left with an open dim by both onnx's inference and the graph's own shape.

    The symbolic inference restarts from the first node after each merge of two dims it finds (one a layer
    where the past lengths are not named as one: `_one_past_length`); the pipeline's later runs, after
    folding and canonicalising, mostly see values an earlier run already named, so they skip it."""
    for name, tensor in graph.tensors().items():
        if isinstance(tensor, gs.Constant):
            continue
        value = found.get(name)
        dims = _dims(value) if value is not None and value.type.HasField("tensor_type") else None
        if (dims is None or any(map(_is_unknown, dims))) and (tensor.shape is None or any(map(_is_unknown, tensor.shape))):
            return True
    return False


def _has_custom_ops(model: onnx.ModelProto) -> bool:
    # the symbolic inference knows onnx's ops and onnxruntime's contrib ops, not ours
    return any(node.domain not in ("", "ai.onnx", "com.microsoft") for node in model.graph.node)


def _more_static(new: list, old) -> bool:
    """Take inferred dims only where they add information: more of them fixed to an int."""
    if len(new) != len(old):
        return True
    return sum(isinstance(d, int) for d in new) > sum(isinstance(d, int) for d in old)


def _is_unknown(dim) -> bool:
    return dim is None or (isinstance(dim, str) and dim.startswith("unk__"))


def _fewer_unknowns(new: list, old) -> bool:
    """As many fixed dims, and fewer dims that are only placeholders (`unk__N`, None)."""
    return len(new) == len(old) and sum(isinstance(d, int) for d in new) >= sum(isinstance(d, int) for d in old) \
        and sum(map(_is_unknown, new)) < sum(map(_is_unknown, old))
