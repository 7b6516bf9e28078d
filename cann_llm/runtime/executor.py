"""Execute a loaded artifact on one of two backends.

`onnxruntime` (the fast path): `cann` ops lowered onto onnxruntime's kernels (cann_llm/runtime/lowering.py), an
InferenceSession per segment built once (one for a graph without host nodes), its weights read by
onnxruntime from the artifact file itself (external data pointing into the `.om`): it loads, pre-packs and
frees them one by one, so loading never holds the weights twice (docs/performance.md#memory-at-run-time);
paged attention inside the same session through the native custom op (cann_llm/runtime/kernels/native), so a
step is one session run; where that library cannot be built (no C compiler), or with `host_attention`,
the paged attention runs as host kernels (numba) between one session per segment. With `share_weights`
each session is built from a saved copy whose pre-packed weights are memory-mapped (cann_llm/runtime/prepacked_cache.py),
so processes serving one artifact share them.
`reference`: onnx's ReferenceEvaluator per segment, with the registry's numpy kernels as its custom ops,
and the host kernels' numpy references: the executable spec the fast path is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from cann_llm.runtime.artifact import SUB_BYTE_TYPES, OmFile
from cann_llm.runtime.embedding_rows import split_off
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.huge_pages import HugePageArena, huge_pages_given
from cann_llm.runtime.kernels import HostRun, float28, float32_panels, host_kernel, is_host_node, native, reference_ops
from cann_llm.runtime.kernels.paged_attention import PagedInputError
from cann_llm.runtime.loader import LoadedModel
from cann_llm.runtime.lowering import POOL_KEY, POOL_VALUE, lower_for_onnxruntime, with_input_scales, with_pool_inputs
from cann_llm.runtime.ops import (CUSTOM_DOMAIN, MATMUL_F28, MATMUL_F32, MATMUL_INT4, PAGED_ATTENTION, PAGED_METADATA, SWIGLU,
                         MatMulF28Input, MatMulQuantInput, attributes)
from cann_llm.runtime.ort_session import process_thread_pool_enabled, session_options
from cann_llm.runtime.proto_utils import constant_operand, graphs_within, initializers_as_inputs
from cann_llm.runtime.prepacked_cache import SAVE_OPTIONS, prepacked_model
from cann_llm.runtime.segments import HostNode, Segment, split_at_host_nodes
from cann_llm.runtime.shape_contract import ShapeContract

log = logging.getLogger("cann_llm")

BACKENDS = ("onnxruntime", "reference")
# what onnxruntime raises for a model it will not build (its pybind exceptions derive from Exception only)
ORT_FAILURES = tuple(getattr(ort_state, name) for name in ("Fail", "InvalidGraph", "InvalidArgument", "NotImplemented",
                                                            "InvalidProtobuf", "RuntimeException"))


class FeedMismatch(ValueError):
    """Feeds that do not match the artifact's inputs: one it has no input for, or an input not fed."""


class Executor:
    """Runs a loaded artifact: `run(feeds) -> {output name: array}`.

    The graph is cut at its host nodes (cann_llm/runtime/segments.py); each segment becomes one session of the
    backend, built once. A paged artifact's PagedAttention nodes are host nodes (the kernel registry's
    `host=True`), reading and writing the page pool passed to `run` as `kv_cache`.
    """

    def __init__(self, loaded: LoadedModel, backend: str = "onnxruntime", threads: int | None = None,
                 spinning: bool = True, host_attention: bool = False, native_matmul: bool = True,
                 share_weights: bool = False, huge_pages: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.loaded = loaded
        self.backend = backend
        self.output_names = loaded.output_names
        self.shape_contract = ShapeContract.of(loaded.metadata)
        model, weights = _inline_sub_byte(loaded.model, loaded.weights)
        self._embeddings = []
        if backend == "onnxruntime":
            model = _pointing_into_the_artifact(model, weights, loaded.om)
            model, self._embeddings = split_off(model, weights, loaded.om)
        try:
            plan = split_at_host_nodes(model, is_host_node)
        except onnx.shape_inference.InferenceError as error:
            # a node the loader's checks let through but onnx cannot type (a domain spelled "ai.onnx", say)
            reason = str(error).splitlines()[0]
            raise AtcError("E13015", loaded.om.path, f"onnx's shape inference fails on the graph: {reason}") from None
        self.native_library = None
        if backend == "onnxruntime" and not host_attention and _only_paged_attention(plan) \
                and _native_attention_serves(loaded):
            try:
                self.native_library = native.library_path()
            except native.NativeUnavailable:
                pass  # the host kernels run the attention instead: slower, the same numbers
        if self.native_library is not None:
            plan = split_at_host_nodes(with_pool_inputs(model), lambda node: False)
        # the sessions' custom ops: also where the paged step is not one session, for float32 weights
        library = self.native_library
        # float32 weights laid out in panels for MatMulF32 where onnxruntime would pre-pack them, unless the
        # native matmuls are off or the pre-packed weights are shared from disk
        wants_panels = native_matmul and not share_weights
        if library is None and backend == "onnxruntime" and any(
                n.op_type == MATMUL_F28.name or (wants_panels and _float32_weight(n, weights, {}) is not None)
                for n in model.graph.node):
            try:
                library = native.library_path()
            except native.NativeUnavailable:
                pass  # onnxruntime's MatMul instead, on F28 weights unpacked here
        panels = wants_panels and library is not None and native.has_float32_panel_matmul()
        # the native matmuls' streamed weights in huge pages where the kernel gives them, unless they are shared
        # from the page cache
        huge = huge_pages and native_matmul and not share_weights and huge_pages_given()
        # Many sessions run in turn. On pools of their own (no process-wide pool, cann_llm/runtime/ort_session.py),
        # a pool left spinning after its run starves the next session's (docs/performance.md#thread-pools), so
        # their threads spin within a run and stop at its end.
        stop_spinning = len(plan) > 1
        self._steps = []
        for step in plan:
            if isinstance(step, HostNode):
                self._steps.append(_HostStep(step.node))
                continue
            try:
                segment = _SegmentStep(step, weights, backend, threads, spinning, stop_spinning, library,
                                       loaded.om, native_matmul, share_weights, panels, huge)
            except ORT_FAILURES as error:
                # a graph the loader's checks let through but onnxruntime will not build: the file is invalid
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise AtcError("E13015", loaded.om.path, f"onnxruntime refuses the graph: {reason}") from None
            self._steps.append(segment)
        self._fast = backend == "onnxruntime"
        if self._fast and len(plan) > 1 and self.native_library is None:
            # imported here, not at the top: `python -m cann_llm.runtime.kernels.warmup` must find it not yet imported
            from cann_llm.runtime.kernels.warmup import warm_up_in_background

            # the numba kernels compile (or load from numba's cache) while the sessions are built
            warm_up_in_background()

    @property
    def num_segments(self) -> int:
        """How many backend sessions one step runs."""
        return sum(isinstance(step, _SegmentStep) for step in self._steps)

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None,
            kv_cache: PagePool | None = None) -> dict[str, np.ndarray]:
        """Outputs named `output_names` (default all) for `feeds`; a paged artifact needs `kv_cache`. Feeds
        outside the shapes the artifact was compiled for are refused (E10001), and with gears run at the
        smallest gear that holds them (cann_llm/runtime/shape_contract.py). ValueError naming a feed the artifact
        has no input for, an input not fed, a feed of the wrong rank, or an output it does not have."""
        names = output_names or self.output_names
        self._check_request(feeds, names)
        if self.shape_contract is None:
            return self._run(dict(feeds), names, kv_cache)
        padded, real = self.shape_contract.fit(feeds)
        return self.shape_contract.cut(self._run(dict(padded), names, kv_cache), real, self.loaded.metadata["signature"])

    def _check_request(self, feeds: dict[str, np.ndarray], names: list[str]) -> None:
        if not isinstance(feeds, Mapping):
            raise TypeError(f"feeds are a dict of input name to array, not {type(feeds).__name__}")
        inputs = {value["name"]: value for value in self.loaded.metadata["signature"]["inputs"]}
        unknown = [name for name in feeds if name not in inputs]
        missing = [name for name in inputs if name not in feeds]
        if unknown or missing:
            said = [f"no input named {', '.join(map(repr, unknown))}"] if unknown else []
            said += [f"{', '.join(map(repr, missing))} not fed"] if missing else []
            raise FeedMismatch(f"{'; '.join(said)}: the model's inputs are {', '.join(inputs)}")
        for name, value in feeds.items():
            rank = len(inputs[name]["shape"])
            if np.ndim(value) != rank:
                raise ValueError(f"input {name!r} has {rank} dimensions {inputs[name]['shape']}; the feed has "
                                 f"{np.ndim(value)} {list(np.shape(value))}")
        outputs = set(self.output_names)
        unknown = [name for name in names if name not in outputs]
        if unknown:
            raise ValueError(f"no output named {', '.join(map(repr, unknown))}: the model's outputs are "
                             f"{', '.join(self.output_names)}")

    def _run(self, values: dict, names: list[str], kv_cache: PagePool | None) -> dict[str, np.ndarray]:
        for gathered in self._embeddings:
            gathered.feed(values)
        if self.native_library is not None:
            return self._run_native(values, names, kv_cache)
        host = HostRun(kv_cache, self._fast) if kv_cache is not None else None
        context = _RunContext(host, names if len(self._steps) == 1 else None)
        for step in self._steps:
            values.update(step.run(values, context))
        return {name: values[name] for name in names}

    def _run_native(self, values: dict, names: list[str], kv_cache: PagePool | None) -> dict[str, np.ndarray]:
        if kv_cache is None:
            raise ValueError("a paged artifact runs with a page pool: pass kv_cache (cann_llm.runtime.engine.kv_cache.PagePool)")
        values[POOL_KEY], values[POOL_VALUE] = kv_cache.key, kv_cache.value
        for meta in PAGED_METADATA:
            # host kernels take any integer type; inside the session onnxruntime holds the contract's
            if meta.name in values:
                values[meta.name] = np.asarray(values[meta.name], meta.dtype)
        try:
            return self._steps[0].run(values, _RunContext(None, names))
        except ORT_FAILURES as error:
            text = str(error)
            if _NATIVE_REFUSAL not in text:
                raise
            raise PagedInputError(text.split(_NATIVE_REFUSAL, 1)[1].strip().splitlines()[0]) from None


@dataclass
class _RunContext:
    """What the steps of one run share besides the values."""

    host: HostRun | None
    names: list[str] | None


# how the native op's refusals of a step's operands begin (cann_llm/runtime/kernels/native/paged_attention.c)
_NATIVE_REFUSAL = "PagedInputError:"


def _native_attention_serves(loaded: LoadedModel) -> bool:
    """Whether the native op can run every PagedAttention: it reads one pool of pages alike in every layer
    (not Gemma 4's, `metadata.model.layer_kv`) and has no sinks (gpt-oss's); the host kernels serve the rest."""
    return "layer_kv" not in loaded.metadata.get("model", {}) and not any(
        node.op_type == PAGED_ATTENTION.name and attributes(node)["sinks"] for node in loaded.model.graph.node)


def _only_paged_attention(plan: list) -> bool:
    """Whether the plan has host nodes and every one is a PagedAttention (what the native op runs)."""
    hosts = [step.node for step in plan if isinstance(step, HostNode)]
    return bool(hosts) and all(node.op_type == PAGED_ATTENTION.name for node in hosts)


def _native_nodes(model: onnx.ModelProto, matmul: bool = True):
    """What the native library runs itself besides PagedAttention: SwiGlu on float32, its only type there (a
    node whose input type the graph does not state is lowered as usual), MatMulInt4 where its int8 kernel
    computes what onnxruntime's MatMulNBits would (`native.takes_matmul`) on float32 activations and packed
    uint8 zero points, and MatMulF28 where the library has it; the matmuls unless `matmul` is off."""
    graph = model.graph
    floats = {v.name for v in [*graph.value_info, *graph.input, *graph.output]
              if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    uint8 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.UINT8}

    def keep(node: onnx.NodeProto) -> bool:
        if node.op_type == SWIGLU.name:
            return node.input[0] in floats
        if node.op_type == MATMUL_INT4.name and matmul:
            zero_points = node.input[3] if len(node.input) > 3 else ""
            return (native.takes_matmul(attributes(node)) and node.input[0] in floats
                    and (not zero_points or zero_points in uint8))
        if node.op_type == MATMUL_F28.name and matmul:
            return native.has_float28_matmul() and node.input[0] in floats
        return False
    return keep


def _unpacked_float28(model: onnx.ModelProto, weights: dict[str, np.ndarray], keep: Callable[[onnx.NodeProto], bool] | None,
                      where: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of `model` whose MatMulF28 nodes that `keep` does not give the native library are onnxruntime
    MatMuls on their weights unpacked to float32 here (onnxruntime has no op that reads bits as a float), and
    those weights by name: the graph declares them as external initializers, which the session is given as
    they are (`_ort_session`'s `unpacked`), so no weight passes through a protobuf (2 GB at most). `model`
    itself is left alone when there are none. Operands that are not the artifact's constants, or do not
    hold F28's layout, are E13015 naming the artifact `where`."""
    def unpacked_here(node: onnx.NodeProto) -> bool:
        return node.domain == CUSTOM_DOMAIN and node.op_type == MATMUL_F28.name and not (keep is not None and keep(node))

    if not any(unpacked_here(node) for node in model.graph.node):
        return model, {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    inline = {t.name: t for t in copy.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}

    def value(node: onnx.NodeProto, slot: MatMulF28Input) -> np.ndarray:
        found = constant_operand(node.input[slot] if slot < len(node.input) else "", weights, inline)
        if found is None:
            raise AtcError("E13015", where, f"{node.name}: MatMulF28's {slot.name.lower()} is not a constant of the artifact")
        return found

    unpacked: dict[str, np.ndarray] = {}
    replaced: set[str] = set()
    for node in copy.graph.node:
        if not unpacked_here(node):
            continue
        name = f"{node.input[MatMulF28Input.PACKED]}/float32"
        if name not in unpacked:
            operands = [value(node, slot) for slot in (MatMulF28Input.PACKED, MatMulF28Input.OFFSETS,
                                                       MatMulF28Input.POSITIONS, MatMulF28Input.VALUES)]
            try:
                unpacked[name] = float28.unpack(*operands, **attributes(node))
            except ValueError as error:
                raise AtcError("E13015", where, f"{node.name}: {error}") from None
            copy.graph.initializer.append(_made_at_load(name, unpacked[name]))
        replaced.update(node.input[1:])
        node.CopyFrom(helper.make_node("MatMul", [node.input[MatMulF28Input.A], name], list(node.output), name=node.name))
    _drop_unread(copy.graph, replaced)
    return copy, unpacked


def _float32_weight(node: onnx.NodeProto, weights: dict[str, np.ndarray],
                    transposed: dict[str, str]) -> tuple[str, bool] | None:
    """The float32 weight of the artifact (`weights`) a MatMul `node` reads as its B, directly or through one of
    the graph's `transposed` tables (a Transpose's output → the table it reads): its name and whether it is read
    transposed; None for other nodes, and for weights the native op does not take."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    if node.input[1] in transposed:
        return transposed[node.input[1]], True
    view = weights.get(node.input[1])
    return (node.input[1], False) if view is not None and float32_panels.takes(view) else None


def _transposed_tables(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> dict[str, str]:
    """The outputs of the graph's Transposes ([1, 0]) of a float32 weight of the artifact the native op takes,
    each to the weight's name."""
    found = {}
    for node in model.graph.node:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.input[0] not in weights:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        if perm == [1, 0] and float32_panels.takes(weights[node.input[0]].T):
            found[node.output[0]] = node.input[0]
    return found


def _made_at_load(name: str, array: np.ndarray) -> onnx.TensorProto:
    """The graph's initializer standing for `array`, a weight the runtime makes as it loads, which the session
    is given as it is (`_ort_session`'s `unpacked`)."""
    stub = onnx.TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                            data_location=onnx.TensorProto.EXTERNAL)
    stub.external_data.add(key="location", value="<made at load>")
    return stub


def _fresh_name(name: str, taken: set[str]) -> str:
    """`name`, or it with underscores after it until no name in `taken` is it; added to `taken`."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _read(graph: onnx.GraphProto) -> set[str]:
    """The names a node of `graph` or of its subgraphs reads, and its outputs."""
    return {name for g in graphs_within(graph) for node in g.node for name in node.input} | {o.name for o in graph.output}


def _drop_unread(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove from `graph` the initializers among `names` (and their declarations as inputs) that no node of it or
    of its subgraphs reads and that are no output of it, once a rewrite stopped reading them."""
    gone = names - _read(graph)
    kept = [t for t in graph.initializer if t.name not in gone]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    declared = [value for value in graph.input if value.name not in gone]
    del graph.input[:]
    graph.input.extend(declared)


def _float32_panels(model: onnx.ModelProto, weights: dict[str, np.ndarray], artifact: OmFile | None,
                    huge: bool = False) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of `model` whose MatMuls on a float32 weight of the artifact (or on its transpose: a tied head) are
    the native library's MatMulF32 on that weight laid out in panels here (cann_llm/runtime/kernels/float32_panels.py),
    and those panels by name, for the session as `_unpacked_float28`'s weights are: what onnxruntime would
    pre-pack for its MatMul, laid out for the kernel that reads it faster at one row; `huge`: laid out in one
    arena of huge pages (cann_llm/runtime/huge_pages.py), where numpy gives huge pages only to arrays of 4 MB or more,
    which left a layer's three smaller weights in small ones. The pages of the artifact read to lay them out are
    released (`artifact`), as onnxruntime leaves them after pre-packing; weights and Transposes nothing reads
    any more go. `model` itself is left alone when there are none."""
    transposed = _transposed_tables(model, weights)

    def oriented(found: tuple[str, bool]) -> np.ndarray:
        return weights[found[0]].T if found[1] else weights[found[0]]

    found_in = {found: None for node in model.graph.node
                if (found := _float32_weight(node, weights, transposed)) is not None}
    if not found_in:
        return model, {}
    arena = None
    if huge:
        try:
            arena = HugePageArena([4 * int(np.prod(float32_panels.shape_of(oriented(found)))) for found in found_in])
        except OSError as error:  # no room for the mapping: numpy's arrays instead
            log.warning("W13003: weights laid out in small pages: no memory for them in huge pages (%s)", error)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    taken = {t.name for t in copy.graph.initializer} | {v.name for v in copy.graph.input}
    panels: dict[str, np.ndarray] = {}
    stubs: dict[tuple[str, bool], str] = {}
    for node in copy.graph.node:
        found = _float32_weight(node, weights, transposed)
        if found is None:
            continue
        source, is_transposed = found
        weight = oriented(found)
        if found not in stubs:
            name = _fresh_name(f"{source}/panels{'_t' if is_transposed else ''}", taken)
            stubs[found] = name
            out = arena.empty(float32_panels.shape_of(weight), np.float32) if arena is not None else None
            panels[name] = float32_panels.pack(weight, out)
            if artifact is not None:
                artifact.release(weights[source])
            copy.graph.initializer.append(_made_at_load(name, panels[name]))
        k, n = weight.shape
        node.CopyFrom(helper.make_node(MATMUL_F32.name, [node.input[0], stubs[found]], list(node.output),
                                       name=node.name, domain=CUSTOM_DOMAIN, K=int(k), N=int(n)))
    read = _read(copy.graph)
    nodes = [node for node in copy.graph.node if node.op_type != "Transpose" or node.output[0] not in transposed
             or node.output[0] in read]
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    _drop_unread(copy.graph, {source for source, _ in stubs})
    return copy, panels


def _in_huge_pages(model: onnx.ModelProto, weights: dict[str, np.ndarray], keep: Callable[[onnx.NodeProto], bool],
                   artifact: OmFile) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of `model` whose native matmuls read the weights they stream from huge pages, each under a name of
    its own, and those weights by name, for the session as `_unpacked_float28`'s weights are. MatMulInt4's
    (`keep`) are copied into an arena of huge pages (cann_llm/runtime/huge_pages.py), the artifact's pages of each released
    once copied. MatMulF28's panels are the artifact's own mapping: `atc` leaves its weights in the page cache in
    huge folios, and a read from disk brings them back so (cann_llm/runtime/artifact.py), which that one mapping of the
    whole file maps whole, where onnxruntime's mapping of each weight on its own maps only the huge folios inside
    it (a copy instead gained 1.025x a step for 1.1 s more load and a peak 90 MB higher on SmolLM2, its tied
    head's 99 MB copied whole). Other readers of a weight (the embedding lookup of a tied head) keep the original.
    `model` itself is left alone when there are none."""
    copied: dict[str, bool] = {}  # each streamed weight: copied (MatMulInt4's) or read in place (MatMulF28's)
    for node in model.graph.node:
        if (slot := _streamed_slot(node, keep)) is not None and node.input[slot] in weights:
            copied.setdefault(node.input[slot], node.op_type == MATMUL_INT4.name)
    if not copied:
        return model, {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    taken = {t.name for t in copy.graph.initializer} | {v.name for v in copy.graph.input}
    arena = None
    if to_copy := [weights[source] for source, copies in copied.items() if copies]:
        try:
            arena = HugePageArena([array.nbytes for array in to_copy])
        except OSError as error:  # no room for the mapping (an overcommit limit, a cgroup): those weights stay put
            log.warning("W13003: weights left in the artifact's pages: no memory for their copy in huge pages (%s)", error)
            copied = {source: copies for source, copies in copied.items() if not copies}
    given, renamed = {}, {}
    for source, copies in copied.items():
        name = renamed[source] = _fresh_name(f"{source}/huge_pages", taken)
        if copies:
            given[name] = arena.copy(weights[source])
            artifact.release(weights[source])
        else:
            given[name] = weights[source]
        copy.graph.initializer.append(_made_at_load(name, given[name]))
    for node in copy.graph.node:
        if (slot := _streamed_slot(node, keep)) is not None and node.input[slot] in renamed:
            node.input[slot] = renamed[node.input[slot]]
    _drop_unread(copy.graph, set(copied))
    return copy, given


def _streamed_slot(node: onnx.NodeProto, keep: Callable[[onnx.NodeProto], bool]) -> int | None:
    """The input of `node` holding the weight a native matmul streams at every step, if it is one."""
    if node.domain != CUSTOM_DOMAIN:
        return None
    if node.op_type == MATMUL_INT4.name and keep(node):
        return MatMulQuantInput.B
    return MatMulF28Input.PACKED if node.op_type == MATMUL_F28.name else None


class _SegmentStep:
    def __init__(self, segment: Segment, weights: dict[str, np.ndarray], backend: str, threads: int | None,
                 spinning: bool, stop_spinning: bool, library=None, artifact: OmFile | None = None,
                 native_matmul: bool = True, share_weights: bool = False, panels: bool = False,
                 huge: bool = False):
        """`panels`: lay the segment's float32 MatMul weights out for the library's MatMulF32 (`_float32_panels`);
        `huge`: the weights the native matmuls stream read from huge pages (`_in_huge_pages`, `_float32_panels`)."""
        self.inputs, self.outputs = segment.inputs, segment.outputs
        if backend == "onnxruntime":
            model, keep = segment.model, None
            if library is not None:
                keep = _native_nodes(model, native_matmul)
                model = with_input_scales(model, keep)
            where = str(artifact.path) if artifact is not None else "the model"
            model, unpacked = _unpacked_float28(model, weights, keep, where)
            if panels:
                model, laid_out = _float32_panels(model, weights, artifact, huge)
                unpacked.update(laid_out)
            if huge and keep is not None and artifact is not None:
                model, copied = _in_huge_pages(model, weights, keep, artifact)
                unpacked.update(copied)
            # onnxruntime reads these buffers for the session's life
            self._unpacked = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in unpacked.items()}
            self._session = _ort_session(lower_for_onnxruntime(model, keep), artifact, threads, spinning,
                                         stop_spinning, library, share_weights, self._unpacked)
            self._weights_fed = {}
        else:
            used = {t.name for t in segment.model.graph.initializer}
            mine = {name: view for name, view in weights.items() if name in used}
            light = initializers_as_inputs(segment.model, _is_external)
            # imported here: onnx's evaluator costs ~11 MB resident that a process on onnxruntime never uses
            from onnx.reference import ReferenceEvaluator

            self._session = ReferenceEvaluator(light, new_ops=reference_ops())
            self._weights_fed = mine

    def run(self, values: dict, context: _RunContext) -> dict[str, np.ndarray]:
        names = context.names or self.outputs
        feeds = {name: values[name] for name in self.inputs if name in values}
        return dict(zip(names, self._session.run(names, {**feeds, **self._weights_fed})))


class _HostStep:
    def __init__(self, node: onnx.NodeProto):
        self.kernel = host_kernel(node)
        self.inputs, self.outputs = list(node.input), list(node.output)
        self.attributes = attributes(node)

    def run(self, values: dict, context: _RunContext) -> dict[str, np.ndarray]:
        if context.host is None:
            raise ValueError("a paged artifact runs with a page pool: pass kv_cache (cann_llm.runtime.engine.kv_cache.PagePool)")
        inputs = [values[name] if name else None for name in self.inputs]
        outputs = self.kernel(*inputs, run=context.host, **self.attributes)
        return dict(zip(self.outputs, outputs if isinstance(outputs, tuple) else (outputs,)))


def _inline_sub_byte(model: onnx.ModelProto, weights: dict[str, np.ndarray]):
    """Copy packed sub-byte weights into the graph: neither numpy nor OrtValue can describe their storage.

    Only DequantizeLinear inputs of QDQ models are stored so; the INT4 matmul's own layout is uint8.
    """
    packed = {t.name for t in model.graph.initializer if t.name in weights and t.data_type in SUB_BYTE_TYPES}
    if not packed:
        return model, weights
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if tensor.name in packed:
            tensor.raw_data = weights[tensor.name].tobytes()
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return copy, {name: view for name, view in weights.items() if name not in packed}


def _pointing_into_the_artifact(model: onnx.ModelProto, weights: dict[str, np.ndarray], om) -> onnx.ModelProto:
    """A copy of `model` whose external initializers name the artifact file itself (location: its name, offsets
    from the start of the file) instead of the weights partition, for onnxruntime to read."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if tensor.name not in weights:
            continue
        view = weights[tensor.name]
        _point_at(tensor, om.path.name, om.file_offset(view), view.nbytes)
    return copy


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `tensor`'s external data the span `offset`, `length` of the file `location`."""
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _stubs_in_the_artifact(model: onnx.ModelProto, unpacked: dict[str, ort.OrtValue], artifact: OmFile) -> onnx.ModelProto:
    """A copy of `model` whose initializers named in `unpacked` are stubs in the artifact file: onnxruntime checks
    that an initializer's external file exists before a session option's value overrides it. A stub's span
    starts at the file's end: the kernels read the value given for it, but a constant onnxruntime folds from an
    initializer when it builds the session (a Reshape of it, say) is computed from the stub's own bytes, and
    those are refused at load as out of bounds rather than read from the file's header."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    end = artifact.path.stat().st_size
    for tensor in copy.graph.initializer:
        if tensor.name in unpacked:
            itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            _point_at(tensor, artifact.path.name, end, int(np.prod(tensor.dims)) * itemsize)
    return copy


def _ort_session(model: onnx.ModelProto, artifact: OmFile | None, threads: int | None,
                 spinning: bool, stop_spinning: bool = False, library=None,
                 share_weights: bool = False, unpacked: dict[str, ort.OrtValue] | None = None) -> ort.InferenceSession:
    """The session of `model`; `unpacked`: the weights `_unpacked_float28`, `_float32_panels` and `_in_huge_pages`
    made, given to onnxruntime as they are (kept alive by the caller)."""
    if unpacked and artifact is not None:
        model = _stubs_in_the_artifact(model, unpacked, artifact)

    def options_for(source_bytes: bool) -> ort.SessionOptions:
        options = session_options(threads)
        for name, value in (unpacked or {}).items():
            if artifact is not None:
                options.add_initializer(name, value)  # used as it is: an external initializer would be copied
            else:
                options.add_external_initializers([name], [value])
        if artifact is not None and source_bytes:
            # external data is looked up beside the model; a model given as bytes has no place of its own
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(artifact.path.resolve().parent))
        if library is not None:
            options.register_custom_ops_library(str(library))
        if process_thread_pool_enabled():
            pass  # the shared pool's workers spin between the sessions' turns: that is the point of sharing it
        elif not spinning:
            # idle worker threads sleep instead of spinning: needed when several sessions share the cores
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        elif stop_spinning:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        # quantized weights are explicit ops here; onnxruntime's own QDQ rewrites would quantize activations
        options.add_session_config_entry("session.disable_quant_qdq", "1")
        return options

    source = model.SerializeToString()
    if not share_weights or unpacked:  # weights unpacked in this process are its own: nothing on disk to share
        return ort.InferenceSession(source, options_for(True), providers=["CPUExecutionProvider"])

    def build(path: str) -> None:
        options = options_for(True)
        options.optimized_model_filepath = path
        for key, value in SAVE_OPTIONS.items():
            options.add_session_config_entry(key, value)
        ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    try:
        saved = prepacked_model(source, artifact.header.checksum if artifact is not None else b"", build)
    except OSError as error:  # no writable cache: serve unshared rather than not at all
        log.warning("W13002: weights not shared: the pre-packed cache cannot be written (%s)", error)
        return ort.InferenceSession(source, options_for(True), providers=["CPUExecutionProvider"])
    options = options_for(False)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # saved optimised already
    return ort.InferenceSession(str(saved), options, providers=["CPUExecutionProvider"])


def _is_external(tensor: onnx.TensorProto) -> bool:
    # weights in the artifact are fed to the reference backend as inputs, never copied into the graph
    return tensor.data_location == onnx.TensorProto.EXTERNAL
