"""PagedKvCachePass: rewrite a fused LLM graph into batches without padding over a runtime-owned paged cache.

Before: `input_ids [B, S]`, `attention_mask`, `past_key_values.*` in and `present.*` out, each
`FusedAttention` concatenating its layer's past. After (../shared/DESIGN.md "Batches without padding"):
the scheduled sequences' tokens flattened into `input_ids [1, T]` and `position_ids [1, T]`, plus the
attention metadata (cann_llm/runtime/ops.py PAGED_METADATA: `query_start_loc [B+1]`, `seq_lens [B]`,
`block_tables [B, M]`, `slot_mapping [T]`); each FusedAttention becomes a `PagedAttention` that writes
its new keys and values into the pages and reads the whole context from them. The cache leaves the
graph's I/O: the runtime owns the pages. A hybrid's recurrent states stay, a row a sequence
(cann_llm/passes/paged_recurrent.py).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.base import PassResult
from cann_llm.passes.graph_utils import replace_all_uses, tidy, toposort, unfused_attention
from cann_llm.passes.match_rotary import match_rotary
from cann_llm.passes.paged_recurrent import drop_padding_products, has_recurrent_states, pack_recurrent_ops, refuse_unpackable
from cann_llm.passes.pattern import const_ints, fused_node, producer, scalar
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import FUSED_ATTENTION, PAGED_ATTENTION, PAGED_METADATA, input_at, positional
from cann_llm.runtime.ops import FusedAttentionInput as Fused
from cann_llm.runtime.ops import FusedAttentionOutput as FusedOutput
from cann_llm.runtime.ops import PagedAttentionInput as Paged

TOKEN_INPUTS = ("input_ids", "position_ids")
# what a PagedAttention keeps of its FusedAttention: the projections and the rotary tables
_KEPT = {Paged.QUERY: Fused.QUERY, Paged.KEY: Fused.KEY, Paged.VALUE: Fused.VALUE, Paged.COS: Fused.COS,
         Paged.SIN: Fused.SIN}
_KEPT_ATTRIBUTES = ("num_heads", "kv_num_heads", "head_dim", "scale", "rotary_interleaved", "sliding_window")


class PagedKvCache:
    """Move the KV cache out of the graph into pages addressed by attention metadata."""

    name = "PagedKvCachePass"
    switchable = False

    def __init__(self, page_size: int, flash: bool = False):
        self.page_size, self.flash = page_size, flash

    def run(self, graph: gs.Graph) -> PassResult:
        attentions = [n for n in toposort(graph).nodes if n.op == FUSED_ATTENTION.name]
        inputs = {t.name: t for t in graph.inputs}
        if "input_ids" in inputs:
            _sizes_from_tokens(graph, inputs["input_ids"])
        if "position_ids" not in inputs and attentions:
            _positions_from_an_input(graph, attentions[0])
            if _positions_unread(graph, attentions) and not any(t.name == "position_ids" for t in graph.inputs):
                # the input every paged artifact takes, read by the attention's metadata alone
                graph.inputs.append(gs.Variable("position_ids", dtype=np.int64, shape=[1, "num_tokens"]))
            inputs = {t.name: t for t in graph.inputs}
        refuse_unpackable(graph)
        recurrent = has_recurrent_states(graph)
        if recurrent:  # a hybrid: its recurrent layers' padding products go before the checks read the mask
            drop_padding_products(graph)
        self._check(graph, attentions)
        metadata = {m.slot: gs.Variable(m.name, dtype=m.dtype, shape=list(m.shape)) for m in PAGED_METADATA}
        if recurrent:
            pack_recurrent_ops(graph, metadata[Paged.QUERY_START_LOC])
        cache_io = set()
        for layer, node in enumerate(attentions):
            cache_io.update(t.name for t in (input_at(node.inputs, slot) for slot in
                                             (Fused.PAST_KEY, Fused.PAST_VALUE, Fused.ATTENTION_MASK)) if t is not None)
            cache_io.update(node.outputs[slot].name for slot in (FusedOutput.PRESENT_KEY, FusedOutput.PRESENT_VALUE)
                            if slot < len(node.outputs))
            operands = positional(Paged, {**{paged: input_at(node.inputs, fused) for paged, fused in _KEPT.items()},
                                          **metadata}, gs.Variable.empty())
            defaults = {**FUSED_ATTENTION.defaults, **node.attrs}
            # flash_prefill attends causally, uncapped, unbiased and sinkless: sliding-window, softcapped, ALiBi
            # and sink layers attend without it
            flash = self.flash and not defaults["sliding_window"] and not defaults["softcap"] \
                and not defaults["alibi_slopes"] and not defaults["sinks"]
            name = node.name.removesuffix(FUSED_ATTENTION.name) + PAGED_ATTENTION.name
            graph.nodes.append(fused_node(
                PAGED_ATTENTION.name, operands, [node.outputs[FusedOutput.OUTPUT]], name,
                **{key: defaults[key] for key in _KEPT_ATTRIBUTES}, layer=layer, page_size=self.page_size,
                flash=int(flash), **({"softcap": defaults["softcap"]} if defaults["softcap"] else {}),
                **({"alibi_slopes": list(defaults["alibi_slopes"])} if defaults["alibi_slopes"] else {}),
                **({"sinks": list(defaults["sinks"])} if defaults["sinks"] else {})))
            node.inputs.clear()
            node.outputs.clear()
        for name in TOKEN_INPUTS:
            inputs[name].shape = [1, "num_tokens"]
        graph.cleanup(remove_unused_graph_inputs=False)  # what only fed the replaced cache reads no input now
        still_read = sorted(t.name for t in graph.inputs if t.name in cache_io and t.outputs)
        if still_read:
            raise AtcError("E10055", f"{', '.join(still_read)} also feed ops other than attention, which a paged "
                                     "cache cannot serve; compile with --enable_paged_attention=0")
        # a mask the export takes and nothing reads (Baichuan-13B ignores it): a flattened batch has none to feed
        cache_io.update(t.name for t in graph.inputs if t.name == "attention_mask" and not t.outputs)
        graph.inputs = [t for t in graph.inputs if t.name not in cache_io] + list(metadata.values())
        graph.outputs = [t for t in graph.outputs if t.name not in cache_io]
        tidy(graph)
        return PassResult(match_times=len(attentions), effect_times=len(attentions))

    @staticmethod
    def _check(graph: gs.Graph, attentions: list[gs.Node]) -> None:
        names = {t.name for t in graph.inputs}
        if not attentions:
            raise AtcError("E10055", "--enable_paged_attention=1 needs the attention fused into FusedAttention, "
                                     "and this model has none (see fusion_result.json); compile it with "
                                     "--enable_paged_attention=0")
        unfused = unfused_attention(graph)
        if unfused:
            # before the checks below: what they find in an unfused block (its mask's Shape, say) hides why
            raise AtcError("E10055", f"--enable_paged_attention=1 needs every attention block fused into "
                                     f"FusedAttention, and {unfused} did not (W10005; --log=debug says why "
                                     "AttentionFusionPass refused each); compile it with --enable_paged_attention=0")
        missing = [name for name in TOKEN_INPUTS if name not in names]
        if missing:
            raise AtcError("E10055", f"--enable_paged_attention=1 needs the graph inputs {', '.join(TOKEN_INPUTS)}; "
                                     f"{', '.join(missing)} missing")
        for node in attentions:
            if input_at(node.inputs, Fused.ATTENTION_BIAS) is not None:
                raise AtcError("E10055", f"{node.name} takes an explicit attention bias, which a paged cache "
                                         "cannot address; compile with --enable_paged_attention=0")
            if not node.attrs.get("causal", FUSED_ATTENTION.defaults["causal"]):
                # a step of one token over a cache needs no mask, and a trace of one leaves none in the graph
                hint = (" (an export traced with one new token over its cache has none: trace it with several)"
                        if input_at(node.inputs, Fused.PAST_KEY) is not None else "")
                raise AtcError("E10055", f"{node.name} attends without a causal mask{hint}, and paged attention is "
                                         "causal; compile with --enable_paged_attention=0")
            for slot in (Fused.PAST_KEY, Fused.PAST_VALUE):
                past = input_at(node.inputs, slot)
                if past is not None and past not in graph.inputs:
                    raise AtcError("E10055", f"{node.name} reads a KV cache that is not a graph input")
        mask = next((t for t in graph.inputs if t.name == "attention_mask"), None)
        if mask is not None and any(c.op != FUSED_ATTENTION.name for c in mask.outputs):
            users = sorted({c.op for c in mask.outputs if c.op != FUSED_ATTENTION.name})
            raise AtcError("E10055", f"attention_mask also feeds {', '.join(users)}, which a flattened batch "
                                     "cannot express; compile with --enable_paged_attention=0")


def _positions_unread(graph: gs.Graph, attentions: list[gs.Node]) -> bool:
    """Whether no part of the graph but the attention's order reads the tokens' positions: no rotary table,
    and either ALiBi's slopes (BLOOM, MPT and Falcon-RW export no positions) or nothing that counts or turns
    (no Range, no CumSum, no Sin or Cos, no rotation left outside the attention: Granite 4.0-H's attention has
    no positions, and TorchScript drops the input it never reads)."""
    if any(input_at(n.inputs, Fused.COS) is not None for n in attentions):
        return False
    return all(n.attrs.get("alibi_slopes") for n in attentions) \
        or not any(n.op in ("Range", "CumSum", "Sin", "Cos") or n.op == "Add" and match_rotary(n.outputs[0])
                   for n in graph.nodes)


def _positions_from_an_input(graph: gs.Graph, attention: gs.Node) -> None:
    """Give a graph that counts its positions itself a `position_ids` input in their place, as a flattened
    batch needs: from the past's length (Optimum's Gemma has no position_ids input: `Range(past, past + S)`;
    transformers 5 counts `Range(0, S) + past`), or, in an export without a cache, from 0 to the tokens'
    count (an export of `input_ids`, with or without its mask: `Range(0, S)`).

    With rotary tables the counter is looked for among what they are computed from; without them (GPT-2's
    learned positions) every counter is taken. Either way it must start at a length read from a past KV
    input, or count the tokens where there is no past. Otherwise the graph is left alone (and refused for
    want of position_ids).
    """
    has_past = any(t.name.startswith("past_key_values") for t in graph.inputs)
    cos = input_at(attention.inputs, Fused.COS)
    if cos is None:
        counters = [n for n in graph.nodes if _counts_positions(n, has_past)]
        if counters:
            _read_from_an_input(graph, counters)
        return
    seen, queue = set(), [cos]
    while queue:
        tensor = queue.pop()
        node = tensor.inputs[0] if tensor.inputs and not isinstance(tensor, gs.Constant) else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if _counts_positions(node, has_past):
            _read_from_an_input(graph, [node])
            return
        queue.extend(node.inputs)


def _counts_positions(node: gs.Node, has_past: bool) -> bool:
    """Whether `node` gives each token its position: a Range from the past's length, or one from 0 with
    the past's length added; a Range from 0 to the tokens' count where there is no past."""
    if node.op == "Range":
        return _reads_past_length(node.inputs[0]) if has_past else _counts_tokens(node)
    if node.op != "Add" or not has_past:
        return False
    return any((counter := producer(first, "Range")) is not None and _counts_tokens(counter)
               and _is_past_length(second) for first, second in (node.inputs, node.inputs[::-1]))


def _is_past_length(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is the past's length itself: axis 2 of a past KV input's shape (`Shape(past, start=2,
    end=3)` or `Gather(Shape(past), 2)`), through casts and reshapes; nothing computed from it."""
    while (step := producer(tensor, *_LENGTH_STEPS)) is not None:
        tensor = step.inputs[0]
    read = producer(tensor, "Shape", "Gather")
    if read is not None and read.op == "Gather":
        if const_ints(read.inputs[1]) != [2] or read.attrs.get("axis", 0) != 0:
            return False
        read = producer(read.inputs[0], "Shape")
        axis = 2 if read is not None and read.attrs.get("start", 0) == 0 else None
    else:
        axis = read.attrs.get("start", 0) if read is not None and read.attrs.get("end") == read.attrs.get(
            "start", 0) + 1 else None
    return axis == 2 and read.inputs[0].name.startswith("past_key_values") and not read.inputs[0].inputs


def _read_from_an_input(graph: gs.Graph, counters: list[gs.Node]) -> None:
    """The values of each Range in `counters` read from a new `position_ids` input instead."""
    positions = gs.Variable("position_ids", dtype=np.int64, shape=[1, "num_tokens"])
    flat = gs.Variable("position_ids_flat", dtype=np.int64, shape=["num_tokens"])
    graph.nodes.append(gs.Node("Reshape", name="position_ids/Flatten", outputs=[flat], inputs=[
        positions, gs.Constant("position_ids_flat_shape", np.array([-1], np.int64))]))
    for node in counters:
        replace_all_uses(graph, node.outputs[0], flat)
    graph.inputs.append(positions)


# what may stand between a sequence length and the Range counting to it, and between the token lookup and
# the Shape that reads the length (Gemma scales its embedding by a constant)
_LENGTH_STEPS = ("Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity")
_SCALING = ("Mul", "Div", "Cast")


def _counts_tokens(node: gs.Node) -> bool:
    """Whether the Range `node` is 0, 1, … up to the sequence length of input_ids: read from axis 1 of the
    shape of input_ids or of its embedding lookup (TorchScript reads it there), through casts and reshapes."""
    start, limit, delta = node.inputs
    if scalar(start) != 0 or scalar(delta) != 1:
        return False
    length = limit
    while (step := producer(length, *_LENGTH_STEPS)) is not None:
        length = step.inputs[0]
    read = producer(length, "Shape", "Gather")
    if read is not None and read.op == "Gather":  # Gather(Shape(x), 1)
        if const_ints(read.inputs[1]) != [1] or read.attrs.get("axis", 0) != 0:
            return False
        read = producer(read.inputs[0], "Shape")
        axis = 1 if read is not None and read.attrs.get("start", 0) == 0 else None
    else:  # Shape(x, start=1, end=2)
        axis = read.attrs.get("start", 0) if read is not None and read.attrs.get("end") == read.attrs.get(
            "start", 0) + 1 else None
    return axis == 1 and _looked_up_from_tokens(read.inputs[0])


def _looked_up_from_tokens(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is input_ids, or its embedding lookup (scaled by constants)."""
    while (step := producer(tensor, *_SCALING)) is not None:
        computed = [t for t in step.inputs if not isinstance(t, gs.Constant)]
        if len(computed) != 1:
            return False
        tensor = computed[0]
    lookup = producer(tensor, "Gather")
    if lookup is not None and isinstance(lookup.inputs[0], gs.Constant) and lookup.attrs.get("axis", 0) == 0:
        tensor = lookup.inputs[1]
    return tensor.name == "input_ids" and not tensor.inputs


def _reads_past_length(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is computed from the shape of a past KV input (and nothing else that varies)."""
    stack, found = [tensor], False
    while stack:
        current = stack.pop()
        if isinstance(current, gs.Constant):
            continue
        if not current.inputs:
            return False  # a graph input read by value
        node = current.inputs[0]
        if node.op == "Shape":
            found |= bool(node.inputs[0].name.startswith("past_key_values"))
            continue
        stack.extend(node.inputs)
    return found


def _sizes_from_tokens(graph: gs.Graph, input_ids: gs.Tensor) -> None:
    """Read sizes from the tokens instead of from the cache inputs that are going away.

    Dynamo exports take the batch size as `Shape(past or mask, start=0, end=1)`, and without a past the
    sequence length as the mask's `Shape(start=1, end=2)` (the two lengths are one symbol there);
    `input_ids` has both.
    """
    names = [t.name for t in graph.inputs]
    has_past = any(name.startswith("past_key_values") for name in names)
    for tensor in graph.inputs:
        if not (tensor.name.startswith("past_key_values") or tensor.name == "attention_mask"):
            continue
        for node in list(tensor.outputs):
            if node.op != "Shape":
                continue
            span = (node.attrs.get("start", 0), node.attrs.get("end"))
            if span == (0, 1) or (tensor.name == "attention_mask" and not has_past and span in ((1, 2), (0, None))):
                node.inputs[0] = input_ids
