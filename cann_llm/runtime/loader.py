"""Load a `.om` for execution: map the file, validate everything in it, hand out zero-copy weights.

Nothing in a file is trusted before it is checked: the container (cann_llm/runtime/artifact.py: header, table,
CRCs, weight references), the metadata (cann_llm/runtime/artifact_schema.py), every `cann` node against its op's
contract and the shapes the file states (cann_llm/runtime/ops.py `check_node`), the metadata against the graph,
and the tokenizer files (parsed, the chat template compiled). A violation is E13015 naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx

from cann_llm.runtime import compatibility
from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.artifact_schema import SchemaViolation, check_metadata
from cann_llm.runtime.embedding_rows import TableRows
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.kernels import supports
from cann_llm.runtime.ops import (ATTENTION_OPS, CUSTOM_DOMAIN, FUSED_ATTENTION, GATHER_INT4, PAGED_ATTENTION,
                                  PAGED_METADATA, ContractViolation, FusedAttentionOutput, GatherInt4Input, attributes,
                                  check_node, input_at)
from cann_llm.runtime.signature import io_signature, llm_dimensions

if TYPE_CHECKING:
    from cann_llm.runtime.tokenizer import TextTokenizer


@dataclass
class LoadedModel:
    """An artifact ready to execute: the graph, weight views into the mapped file, and metadata."""

    om: OmFile
    model: onnx.ModelProto
    weights: dict[str, np.ndarray]
    metadata: dict
    tokenizer: TextTokenizer | None = None  # parsed once, by the validation; None without a tokenizer.json

    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of the input embedding table the graph gathers `input_ids` from, as float32 `[n, hidden]`
        (an INT4 table dequantized); ValueError for an id outside the table or when the graph reads no such
        table."""
        from cann_llm.runtime.kernels.matmul_nbits_layout import dequantize_matmul_nbits

        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise TypeError("token ids are a sequence of integers")
        ids = ids.astype(np.int64)
        for node in self.model.graph.node:
            if node.input[1:2] != ["input_ids"] or node.input[0] not in self.weights:
                continue
            table = self.weights[node.input[0]]
            outside = ids[(ids < 0) | (ids >= table.shape[0])]
            if outside.size:  # numpy would count a negative id from the end
                raise ValueError(f"token id {outside[0]} is outside the vocabulary [0, {table.shape[0]})")
            if node.op_type == "Gather" and table.ndim == 2:
                # read, not indexed through the mapping: a document's thousands of distinct tokens would map
                # most of the table into this process (cann_llm/runtime/embedding_rows.py says why)
                rows = TableRows(str(self.om.path), self.om.file_offset(table), node.input[0], tuple(table.shape),
                                 table.dtype)
                return np.asarray(rows(ids), dtype=np.float32)
            if node.op_type == GATHER_INT4.name:
                attrs = attributes(node)
                scales = self.weights[node.input[GatherInt4Input.SCALES]]
                rows = dequantize_matmul_nbits(table[ids], scales[ids], None, attrs["K"], attrs["block_size"])
                return rows.T.astype(np.float32)
        raise ValueError(f"{self.om.path} gathers input_ids from no weight table")

    @property
    def input_names(self) -> list[str]:
        return [value["name"] for value in self.metadata["signature"]["inputs"]]

    @property
    def output_names(self) -> list[str]:
        return [value["name"] for value in self.metadata["signature"]["outputs"]]

    @property
    def kv_cache(self) -> dict:
        """The KV layout the artifact was compiled for: `{"layout": "contiguous"}` (past/present graph I/O)
        or `{"layout": "paged", "page_size": P}` (the runtime's page pool, PagedAttention nodes)."""
        return self.metadata.get("kv_cache", {"layout": "contiguous"})

    @property
    def paged(self) -> bool:
        """Whether the artifact runs over a page pool the runtime owns."""
        return self.kv_cache["layout"] == "paged"


def load_artifact(path: str | os.PathLike, verify_weights: bool = True, tokenizer: bool = True) -> LoadedModel:
    """Open and validate `path`; refuses truncated, corrupted, foreign, inconsistent or unrunnable files
    (AtcError: E13015 naming the field, E16002 for an op without a kernel). `tokenizer=False` leaves the
    tokenizer files unread (a pipeline stage's process: its engine holds the tokenizer, and parsing one
    costs tens of MB)."""
    om = OmFile(path, verify_weights=verify_weights)
    metadata = om.metadata
    try:
        check_metadata(metadata)
    except SchemaViolation as error:
        raise AtcError("E13015", om.path, str(error)) from None
    compatibility.check(metadata, str(om.path))
    model = om.graph()
    missing = sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node if not supports(n.domain, n.op_type)})
    if missing:
        raise AtcError("E16002", ", ".join(missing))
    weights = om.weights(model)
    try:
        _check_graph(model, metadata)
    except ContractViolation as error:
        raise AtcError("E13015", om.path, str(error)) from None
    return LoadedModel(om=om, model=model, weights=weights, metadata=metadata,
                       tokenizer=_check_tokenizer(om) if tokenizer else None)


def _check_graph(model: onnx.ModelProto, metadata: dict) -> None:
    """The `cann` nodes against their contract, the signature and the paged layout against the graph."""
    graph = model.graph
    _check_opsets(model)
    _check_signature(model, metadata["signature"])
    _check_wiring(graph)
    shape_of = _known_shapes(graph)
    attentions = []
    for node in graph.node:
        if node.domain != CUSTOM_DOMAIN:
            continue
        check_node(node, shape_of)
        if node.op_type in ATTENTION_OPS:
            attentions.append((node, attributes(node)))
    _check_dimensions(metadata, attentions)
    if metadata.get("kv_cache", {}).get("layout") == "paged":
        _check_paged(metadata, attentions)
    else:
        paged = next((node for node, _ in attentions if node.op_type == PAGED_ATTENTION.name), None)
        if paged is not None:
            raise ContractViolation(f"node {paged.name}: a PagedAttention, but metadata.kv_cache does not say "
                                    f"the layout is paged")


def _check_dimensions(metadata: dict, attentions: list[tuple[onnx.NodeProto, dict]]) -> None:
    """metadata.model (what runners size their caches by) agrees with the signature and the attention nodes."""
    dims = llm_dimensions(metadata["signature"])
    if dims and "model" not in metadata:
        raise ContractViolation("metadata.model: missing for a causal LM (input_ids in, logits out)")
    model = metadata.get("model", {})
    for key, value in dims.items():
        if isinstance(value, str):
            continue  # a symbolic dim of the past inputs (onnxruntime-genai's `kv_cache_dim`): the nodes decide
        if model.get(key) != value:
            raise ContractViolation(f"metadata.model.{key}: {model.get(key)!r}, the graph makes it {value!r}")
    # past inputs feed every layer, fused or not (one whose attention did not fuse runs on its past input);
    # without them the runner sizes the cache by the attention nodes, one per layer
    # a fused op that writes no present reuses an earlier layer's cache (Gemma 3n): no past input is its own
    owners = [node for node, _ in attentions if node.op_type != FUSED_ATTENTION.name or not dims.get("kv_cache_io")
              or input_at(node.output, FusedAttentionOutput.PRESENT_KEY) is not None]
    partial = dims.get("kv_cache_io") and len(owners) <= model.get("num_layers", 0)
    if attentions and "num_layers" in model and model["num_layers"] != len(owners) and not partial:
        raise ContractViolation(f"metadata.model.num_layers: {model['num_layers']}, the graph has {len(owners)} "
                                f"attention nodes with a cache of their own")
    listed = model.get("layer_kv")
    # layer_kv lists each attention node's KV sizes, or with past inputs each cache's (which nodes may share)
    if listed is not None and not dims.get("kv_cache_io") and len(listed) != len(attentions):
        raise ContractViolation(f"metadata.model.layer_kv: {len(listed)} layers, the graph has {len(attentions)} "
                                f"attention nodes")
    for index, (node, attrs) in enumerate(attentions):
        sizes = model
        if listed is not None:
            own = [attrs["kv_num_heads"], attrs["head_dim"]]
            sizes = dict(zip(("num_kv_heads", "head_dim"), own if dims.get("kv_cache_io") and own in listed
                             else listed[min(index, len(listed) - 1)]))
        for attr, key in (("num_heads", "num_heads"), ("kv_num_heads", "num_kv_heads"), ("head_dim", "head_dim")):
            expected = model.get(key) if key == "num_heads" else sizes.get(key)
            if expected is not None and attrs[attr] != expected:
                raise ContractViolation(f"node {node.name}: {attr} {attrs[attr]} is not metadata.model's {key} "
                                        f"{expected}")


def _check_opsets(model: onnx.ModelProto) -> None:
    """Every node's domain imported once, at a version a backend can take."""
    versions = {}
    for opset in model.opset_import:
        domain = opset.domain or "ai.onnx"
        if domain in versions:
            raise ContractViolation(f"opset_import: {domain} is imported twice")
        versions[domain] = opset.version
    if "ai.onnx" in versions and not 1 <= versions["ai.onnx"] <= onnx.defs.onnx_opset_version():
        raise ContractViolation(f"opset_import: ai.onnx version {versions.get('ai.onnx')} is not one onnx knows "
                                f"(1 to {onnx.defs.onnx_opset_version()})")
    for node in model.graph.node:
        if (node.domain or "ai.onnx") not in versions:
            raise ContractViolation(f"node {node.name}: domain {node.domain or 'ai.onnx'} is not imported")


def _check_signature(model: onnx.ModelProto, signature: dict) -> None:
    """The metadata's signature is the graph's own I/O (as the compiler recorded it): names, dtypes, shapes."""
    try:
        actual = io_signature(model)
    except (KeyError, TypeError, ValueError) as error:  # an elem_type without a numpy dtype
        raise ContractViolation(f"graph: an input or output has no tensor type ({error})") from None
    for side in ("inputs", "outputs"):
        stated = {value["name"]: value for value in signature[side]}
        for value in actual[side]:
            if value["name"] not in stated:
                raise ContractViolation(f"metadata.signature.{side}: the graph's {value['name']} is missing")
            if stated[value["name"]] != value:
                raise ContractViolation(f"metadata.signature.{side}: {value['name']} is {stated[value['name']]}, the "
                                        f"graph's is {value}")
        extra = sorted(set(stated) - {value["name"] for value in actual[side]})
        if extra:
            raise ContractViolation(f"metadata.signature.{side}: {extra[0]} is not one of the graph's {side}")


def _check_wiring(graph: onnx.GraphProto) -> None:
    """Every value defined once (a graph input, an initializer or one node's output) and before any node
    reads it; every graph output defined. Names a subgraph reads from the enclosing graph are its own
    business: its node is checked by the backend that runs it."""
    inputs, initializers = [v.name for v in graph.input], [t.name for t in graph.initializer]
    for kind, names in (("input", inputs), ("initializer", initializers)):
        if len(set(names)) != len(names):
            raise ContractViolation(f"graph: two {kind}s share a name")
    # an initializer may also be listed as an input (IR < 4 style): the one value, defined once
    defined = set(inputs) | set(initializers)
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                raise ContractViolation(f"node {node.name}: input {name} is defined by no input, initializer or "
                                        f"earlier node")
        for name in node.output:
            if name in defined:
                raise ContractViolation(f"node {node.name}: output {name} is defined twice")
            if name:
                defined.add(name)
    for value in graph.output:
        if value.name not in defined:
            raise ContractViolation(f"graph: output {value.name} is defined by no node")


def _check_paged(metadata: dict, attentions: list[tuple[onnx.NodeProto, dict]]) -> None:
    """Every PagedAttention addresses the page pool the runtime builds from the metadata."""
    model, page_size = metadata["model"], metadata["kv_cache"]["page_size"]
    signature = {value["name"]: value for value in metadata["signature"]["inputs"]}
    for meta in PAGED_METADATA:
        if meta.name not in signature or np.dtype(signature[meta.name]["dtype"]) != np.dtype(meta.dtype):
            raise ContractViolation(f"metadata.signature.inputs: a paged model needs {meta.name} of "
                                    f"{np.dtype(meta.dtype)}")
    layers = set()
    for node, attrs in attentions:  # heads and head size: _check_dimensions, against metadata.model
        if node.op_type != PAGED_ATTENTION.name:
            raise ContractViolation(f"node {node.name}: a {node.op_type} in a paged model")
        if attrs["page_size"] != page_size:
            raise ContractViolation(f"node {node.name}: page_size {attrs['page_size']} is not the page pool's "
                                    f"{page_size} (metadata.kv_cache.page_size)")
        if not attrs["layer"] < model["num_layers"] or attrs["layer"] in layers:
            raise ContractViolation(f"node {node.name}: layer {attrs['layer']} is outside the pool's "
                                    f"{model['num_layers']} layers or taken by another node")
        layers.add(attrs["layer"])


def _known_shapes(graph: onnx.GraphProto):
    """`shape_of(name)`: a tensor's dims as the file states them (None where a dim or the tensor is unknown):
    initializers, the graph's typed values, and MatMul products of a constant weight (their last dim)."""
    shapes: dict[str, tuple] = {}
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    for tensor in graph.initializer:
        shapes[tensor.name] = tuple(tensor.dims)
    for node in graph.node:
        if node.op_type == "MatMul" and not node.domain and len(node.input) == 2 and node.output:
            weight = shapes.get(node.input[1])
            if weight and len(weight) == 2 and node.output[0] not in shapes:
                shapes[node.output[0]] = (None, None, weight[1])
    return shapes.get


def _check_tokenizer(om: OmFile) -> TextTokenizer | None:
    """The tokenizer files parse and the chat template compiles, so nothing fails on first use; returns the
    tokenizer (None without a tokenizer.json)."""
    files = om.tokenizer_files()
    if not files:
        return None
    for name in ("tokenizer_config.json", "generation_config.json"):
        if name in files:
            try:
                config = json.loads(files[name])
            except ValueError as error:
                raise AtcError("E13015", om.path, f"tokenizer file {name} is not JSON ({error})") from None
            if not isinstance(config, dict):
                raise AtcError("E13015", om.path, f"tokenizer file {name} is not a JSON object")
    # imported here: tokenizers and jinja2 cost ~9 MB resident that a pipeline stage's process never uses
    from jinja2 import TemplateError

    from cann_llm.runtime.chat_template import ChatTemplate
    from cann_llm.runtime.tokenizer import TextTokenizer

    tokenizer = None
    if "tokenizer.json" in files:
        try:
            tokenizer = TextTokenizer(files)
        except Exception as error:  # tokenizers raises plain Exceptions; a bad eos id a TypeError or ValueError
            raise AtcError("E13015", om.path, f"tokenizer file tokenizer.json is invalid ({error})") from None
    try:
        ChatTemplate(files)
    except AtcError:
        pass  # no chat template: `chat` refuses the model when asked, with its own message
    except (TemplateError, KeyError, TypeError, AttributeError) as error:
        raise AtcError("E13015", om.path, f"the chat template does not compile ({error})") from None
    return tokenizer
