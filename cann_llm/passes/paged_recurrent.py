"""A hybrid's recurrent layers in a flattened batch: the part of PagedKvCachePass that pages no keys and values.

A gated delta net or a short convolution carries one state of fixed size per sequence (`past.N.conv`,
`past.N.recurrent`, cann_llm/models/recurrent_export.py). In a paged artifact those inputs and outputs stay,
one row per scheduled sequence (`num_seqs`, in the order of `query_start_loc`), and the runtime keeps each
sequence's rows between steps (cann_llm/runtime/engine/state_pool.py). Over the flattened tokens each op
runs in its packed form, the sequences cut apart by `query_start_loc` as onnxruntime's ops take them
(`cu_seqlens`):

    GatedDeltaNet([1, T, H, D] ...)            → Unsqueeze(GatedDeltaNet(Squeeze([1, T, H, D]) ..., cu_seqlens))
    CausalConvWithState([1, C, T], w, b, s)    → [1, C, T] of VarlenCausalConvWithState([T, C], w, cu_seqlens, b, s)

transformers also multiplies a recurrent layer's input by the tokens' own padding flags (a Slice of
attention_mask); a flattened batch has no padding, so that product is its other operand.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import replace_all_uses
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import (CAUSAL_CONV_WITH_STATE, GATED_DELTA_NET, MICROSOFT_DOMAIN,
                                  VARLEN_CAUSAL_CONV_WITH_STATE, CausalConvInput, GatedDeltaNetInput, StateOutput,
                                  VarlenCausalConvInput, input_at, positional)
from cann_llm.runtime.signature import STATE_NAME, is_state

# what may stand between attention_mask and the product that zeroes a recurrent layer's padded tokens
_MASK_STEPS = ("Slice", "Unsqueeze", "Cast", "Reshape", "Squeeze")
_RECURRENT_OPS = (GATED_DELTA_NET.name, CAUSAL_CONV_WITH_STATE.name)


def has_recurrent_states(graph: gs.Graph) -> bool:
    """Whether the graph carries a hybrid's recurrent states."""
    return any(STATE_NAME.match(t.name) for t in graph.inputs)


def drop_padding_products(graph: gs.Graph) -> int:
    """Each product of an activation by attention_mask's flags alone (through Slices, Unsqueezes, Casts and
    Reshapes) becomes the activation: a flattened batch has no padding. Returns how many."""
    mask = next((t for t in graph.inputs if t.name == "attention_mask"), None)
    dropped, frontier = 0, [mask] if mask is not None else []
    while frontier:
        tensor = frontier.pop()
        for node in list(tensor.outputs):
            if node.op in _MASK_STEPS and node.inputs[0] is tensor:
                frontier.append(node.outputs[0])
            elif node.op == "Mul" and len(node.inputs) == 2:
                other = node.inputs[1] if node.inputs[0] is tensor else node.inputs[0]
                result = node.outputs[0]
                if other.shape is not None and result.shape is not None and len(other.shape) == len(result.shape):
                    replace_all_uses(graph, result, other)
                    dropped += 1
    graph.cleanup(remove_unused_graph_inputs=False)
    return dropped


def pack_recurrent_ops(graph: gs.Graph, query_start_loc: gs.Variable) -> None:
    """Rewrite each GatedDeltaNet and CausalConvWithState into its packed form over the flattened tokens,
    the state inputs and outputs given one row per sequence."""
    nodes = [n for n in graph.nodes if n.domain == MICROSOFT_DOMAIN and n.op in _RECURRENT_OPS]
    for node in nodes:
        if node.op == GATED_DELTA_NET.name:
            _pack_gated_delta_net(graph, node, query_start_loc)
        else:
            _pack_convolution(graph, node, query_start_loc)
    for tensor in [*graph.inputs, *graph.outputs]:
        if is_state(tensor.name) and tensor.shape:
            tensor.shape = ["num_seqs", *tensor.shape[1:]]


def _replace(graph: gs.Graph, node: gs.Node, op: str, attrs: dict, inputs: list, output: gs.Variable) -> None:
    """`node` replaced by its packed form `op`, which writes `output` and takes over the node's state output."""
    packed = gs.Node(op, name=node.name, domain=MICROSOFT_DOMAIN, attrs=attrs, inputs=inputs,
                     outputs=[output, node.outputs[StateOutput.STATE]])
    node.inputs.clear()
    node.outputs.clear()
    graph.nodes.append(packed)


def _reshaped(graph: gs.Graph, op: str, tensor: gs.Tensor, name: str, shape, into: gs.Variable | None = None,
              **attrs) -> gs.Variable:
    """`op` (Squeeze or Unsqueeze of axis 0, or a Transpose) of `tensor`, written into `into` (which it takes
    over from its producer) or a new tensor of `shape`."""
    out = into if into is not None else gs.Variable(name, dtype=tensor.dtype, shape=shape)
    out.inputs.clear()
    inputs = [tensor]
    if op in ("Squeeze", "Unsqueeze"):
        inputs.append(gs.Constant(f"{name}_axes", np.array([0], np.int64)))
    graph.nodes.append(gs.Node(op, name=name, attrs=attrs, inputs=inputs, outputs=[out]))
    return out


def _flat(graph: gs.Graph, tensor: gs.Tensor | None, name: str) -> gs.Tensor | None:
    """[1, T, ...] → [T, ...]."""
    if tensor is None:
        return None
    return _reshaped(graph, "Squeeze", tensor, name, None if tensor.shape is None else list(tensor.shape[1:]))


def _pack_gated_delta_net(graph: gs.Graph, node: gs.Node, cu_seqlens: gs.Variable) -> None:
    slots = GatedDeltaNetInput
    query = input_at(node.inputs, slots.QUERY)
    if input_at(node.inputs, slots.CU_SEQLENS) is not None or query.shape is None or len(query.shape) != 4:
        raise AtcError("E10055", f"{node.name} is not a GatedDeltaNet over [batch, seq, heads, size] rows, which "
                                 f"the paged engine packs; compile with --enable_paged_attention=0")
    operands = {slot: _flat(graph, input_at(node.inputs, slot), f"{node.name}/{slot.name.lower()}_flat")
                for slot in (slots.QUERY, slots.KEY, slots.VALUE, slots.DECAY, slots.BETA)}
    operands[slots.CU_SEQLENS] = cu_seqlens
    operands[slots.INITIAL_STATE] = input_at(node.inputs, slots.INITIAL_STATE)
    output = node.outputs[StateOutput.OUTPUT]
    value = operands[slots.VALUE]
    flat_out = gs.Variable(f"{node.name}/output_flat", dtype=output.dtype, shape=value.shape)
    _replace(graph, node, node.op, dict(node.attrs), positional(slots, operands, gs.Variable.empty()), flat_out)
    _reshaped(graph, "Unsqueeze", flat_out, f"{node.name}/output", None, into=output)


def _pack_convolution(graph: gs.Graph, node: gs.Node, cu_seqlens: gs.Variable) -> None:
    slots = CausalConvInput
    x, state = input_at(node.inputs, slots.INPUT), input_at(node.inputs, slots.PAST_STATE)
    if x.shape is None or len(x.shape) != 3 or state is None or node.attrs.get("channels_last", 0) \
            or node.attrs.get("ndim", 1) != 1:
        raise AtcError("E10055", f"{node.name} is not a causal convolution over [batch, channels, seq] with a "
                                 f"state, which the paged engine packs; compile with --enable_paged_attention=0")
    channels = x.shape[1]
    tokens = _reshaped(graph, "Transpose", _flat(graph, x, f"{node.name}/input_flat"), f"{node.name}/input_tokens",
                       [None, channels], perm=[1, 0])
    output = node.outputs[StateOutput.OUTPUT]
    out_tokens = gs.Variable(f"{node.name}/output_tokens", dtype=output.dtype, shape=[None, channels])
    operands = {VarlenCausalConvInput.INPUT: tokens, VarlenCausalConvInput.WEIGHT: input_at(node.inputs, slots.WEIGHT),
                VarlenCausalConvInput.CU_SEQLENS: cu_seqlens, VarlenCausalConvInput.BIAS: input_at(node.inputs, slots.BIAS),
                VarlenCausalConvInput.INITIAL_STATE: state}
    attrs = {k: v for k, v in node.attrs.items() if k in VARLEN_CAUSAL_CONV_WITH_STATE.defaults}
    _replace(graph, node, VARLEN_CAUSAL_CONV_WITH_STATE.name, attrs,
             positional(VarlenCausalConvInput, operands, gs.Variable.empty()), out_tokens)
    channels_first = _reshaped(graph, "Transpose", out_tokens, f"{node.name}/output_channels", [channels, None],
                               perm=[1, 0])
    _reshaped(graph, "Unsqueeze", channels_first, f"{node.name}/output", None, into=output)


def refuse_unpackable(graph: gs.Graph) -> None:
    """E10055 for a recurrence the paged engine cannot run per sequence: a state that only plain ops read (a
    convolution written as Concat, Conv and Slice, from an export not made by cann-run export), a recurrent op
    whose state is no graph input, or a convolution over the tokens with no state at all (a hybrid exported
    without its cache): over a flattened batch it would mix the sequences."""
    remedy = "export the model with its states as cache tensors (cann-run export, without --no-past), or " \
             "compile with --enable_paged_attention=0"
    recurrent = [n for n in graph.nodes if n.domain == MICROSOFT_DOMAIN and n.op in _RECURRENT_OPS]
    readers = {id(t) for n in recurrent for t in n.inputs}
    loose = sorted(t.name for t in graph.inputs if STATE_NAME.match(t.name) and id(t) not in readers)
    if loose:
        raise AtcError("E10055", f"{', '.join(loose)} feed ops other than onnxruntime's GatedDeltaNet and "
                                 f"CausalConvWithState, which the paged engine runs per sequence: {remedy}")
    states = {id(t) for t in graph.inputs if STATE_NAME.match(t.name)}
    slots = {GATED_DELTA_NET.name: GatedDeltaNetInput.INITIAL_STATE, CAUSAL_CONV_WITH_STATE.name: CausalConvInput.PAST_STATE}
    stateless = [n.name for n in recurrent if id(input_at(n.inputs, slots[n.op])) not in states]
    stateless += [n.name for n in graph.nodes if n.op == "Conv"]
    if stateless:
        raise AtcError("E10055", f"{stateless[0]} runs a recurrence over the tokens without a state the engine "
                                 f"carries per sequence, and over a flattened batch it would mix the sequences: "
                                 f"{remedy}")
