"""LatentAttentionAbsorptionPass: multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash)
as attention of every query head to one key head over the cached latent, which a paged cache can hold.

transformers caches MLA's latent c [B, 1, T, L] (as the key) and its rotated key part r [B, 1, T, R] (as the
value), and expands both at every step through the up-projection W [L, H·(N + V)]:

    k_h = [c·W_k,h | r],   v_h = c·W_v,h,   o_h = softmax(s·[q_n,h | q_r,h]·k_hᵀ + mask)·v_h

(W_k,h [L, N] and W_v,h [L, V] are head h's columns of W). The products associate the other way round, the
absorption of DeepSeek-V2's paper:

    q_n,h·(c·W_k,h)ᵀ = (q_n,h·W_k,hᵀ)·cᵀ,   p·(c·W_v,h) = (p·c)·W_v,h

so with the query [q_n,h·W_k,hᵀ | q_r,h] [L + R] and one key head [c | r] [L + R], which is also the value,
each head's output is the first L columns of its attention output, times W_v,h. That is the spelling
AttentionFusionPass reads (a key and value head every query head shares, a scale, a mask), and the cache the
fused op keeps is [c | r] a token: L + R values where the expanded keys and values take H·(N + R + V).

In a paged compile, whose cache leaves the graph's I/O: the past inputs and present outputs of each such layer
take [B, 1, T, L + R] (keys and values alike), and the graph no longer expands the cache each step. The
rotations stay in the graph (per token, so a flattened batch rotates alike), as do the scale and mask."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.match_attention import is_transpose, match_probabilities, match_scale, split_mask
from cann_llm.passes.pattern import FusionPass, producer, sole_consumer

# how far back the keys' assembly is followed (transformers writes it as ScatterNDs into zeros, with their
# indices computed from shapes)
_KEY_NODES = 200


@dataclass
class Cache:
    """One of the two tensors transformers caches [B, 1, T, D]: past (a graph input) and new, concatenated on
    the tokens, or the new alone (an export without a past: `past` None, `present` the new)."""

    past: gs.Variable | None
    new: gs.Tensor
    present: gs.Tensor


@dataclass
class LatentAttention:
    query: gs.Node  # Concat [B, H, S, N + R] of the unrotated part [N] and the rotated one
    query_reader: gs.Node  # what reads it on the way to the scores
    scores: gs.Node  # MatMul(query, kᵀ)
    key_scale: float  # the scalar factors on kᵀ's side
    context: gs.Node  # MatMul(probabilities, values)
    latent: Cache  # c [B, 1, T, L]
    rotated: Cache  # r [B, 1, T, R]
    up: np.ndarray  # W as [L, H, N + V]
    nope: int
    name: str


def _cache(graph: gs.Graph, tensor: gs.Tensor) -> Cache | None:
    """The cache `tensor` [B, 1, T, D] is, None when it is not one head of static width."""
    shape = tensor.shape
    if shape is None or len(shape) != 4 or shape[1] != 1 or not isinstance(shape[-1], int):
        return None
    concat = producer(tensor, "Concat")
    if concat is not None and len(concat.inputs) == 2 and concat.attrs.get("axis") in (2, -2) \
            and any(concat.inputs[0] is t for t in graph.inputs):
        return Cache(concat.inputs[0], concat.inputs[1], tensor)
    return Cache(None, tensor, tensor)


def _reader_on_path(consumer: gs.Node, start: gs.Tensor, target: gs.Tensor) -> gs.Node | None:
    """The node reading `target` on the chain of scalar factors (match_scale's) from `start` to `consumer`."""
    if start is target:
        return consumer
    node = producer(start)
    while node is not None:
        if any(t is target for t in node.inputs):
            return node
        inner = next((t for t in node.inputs if not isinstance(t, gs.Constant)), None)
        node = producer(inner) if inner is not None else None
    return None


def _scale_on_path(tensor: gs.Tensor) -> tuple[gs.Tensor, float]:
    """(what `tensor` scales, the product of its scalar factors) through transposes and scalar factors."""
    factor = 1.0
    while True:
        tensor, step = match_scale(tensor)
        factor *= step
        transpose = producer(tensor, "Transpose")
        if transpose is None:
            return tensor, factor
        tensor = transpose.inputs[0]


# ops that move values without computing others, and the inputs that carry the values (None: all)
_MOVES = {"Transpose": (0,), "Reshape": (0,), "Unsqueeze": (0,), "Squeeze": (0,), "Expand": (0,), "Slice": (0,),
          "Identity": (0,), "Cast": (0,), "Split": (0,), "ScatterND": (0, 2), "Concat": None}


def _zeros(tensor: gs.Tensor) -> bool:
    """Whether `tensor` is zeros: a constant, or ConstantOfShape's (what transformers' keys are scattered into)."""
    if isinstance(tensor, gs.Constant):
        return not np.any(tensor.values)
    node = producer(tensor, "ConstantOfShape")
    value = node.attrs.get("value") if node is not None else None
    return node is not None and (value is None or not np.any(getattr(value, "values", value)))


def _key_sources(keys: gs.Tensor, stop) -> tuple[list[gs.Tensor], set[int]] | str:
    """(the tensors the keys' values are moved from, the ids of the nodes that move them): those `stop(tensor)`
    accepts, through ops that only move values (into zeros, for a scatter). A value computed on the way is refused:
    the rewrite replaces the whole path."""
    found, seen, moved, todo = [], set(), set(), [keys]
    while todo:
        tensor = todo.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if stop(tensor):
            found.append(tensor)
            continue
        if _zeros(tensor):
            continue
        node = producer(tensor)
        if node is None or node.op not in _MOVES:
            return f"the keys are computed ({node.op if node else tensor.name}), not only moved, from the latent"
        if len(moved) > _KEY_NODES:
            return "the keys are assembled from more than the latent and the rotated key"
        moved.add(id(node))
        carried = _MOVES[node.op]
        todo.extend(node.inputs if carried is None else [node.inputs[i] for i in carried if i < len(node.inputs)])
    return found, moved


class AbsorbLatentAttention(FusionPass):
    """Rewrite each multi-head latent attention into one shared key and value head over its cached latent."""

    name = "LatentAttentionAbsorptionPass"
    anchor = "Softmax"

    def match(self, graph: gs.Graph, softmax: gs.Node) -> LatentAttention | str:
        logits, _, _ = split_mask(softmax.inputs[0])
        scores = producer(match_scale(logits)[0], "MatMul")
        if scores is None:
            return "the softmax input is not a (scaled, masked) MatMul"
        context = sole_consumer(graph, match_probabilities(graph, softmax), "MatMul")
        if context is None:
            return "the probabilities do not multiply the values"
        split = producer(context.inputs[1], "Split")
        if split is None or len(split.outputs) != 2 or split.outputs[1] is not context.inputs[1]:
            return "the values are not the second part of a split"
        transpose = producer(split.inputs[0], "Transpose")
        reshape = producer(transpose.inputs[0], "Reshape") if is_transpose(transpose, [0, 2, 1, 3]) else None
        expand = producer(reshape.inputs[0], "MatMul") if reshape is not None else None
        if expand is None or not isinstance(expand.inputs[1], gs.Constant):
            return "the values are not an up-projection of a cache"
        latent = _cache(graph, expand.inputs[0])
        if latent is None:
            return "the up-projection does not read a latent of one head"
        key_part, values = split.outputs
        shapes = key_part.shape, values.shape, latent.present.shape, reshape.outputs[0].shape
        if any(s is None or not isinstance(s[-1], int) for s in shapes):
            return "the latent attention's sizes are not static"
        nope, width, rank = key_part.shape[-1], values.shape[-1], latent.present.shape[-1]
        weight = expand.inputs[1].values
        heads = reshape.outputs[0].shape[-2]
        if not isinstance(heads, int) or reshape.outputs[0].shape[-1] != nope + width \
                or weight.shape != (rank, heads * (nope + width)):
            return "the up-projection is not [latent, heads · (key part + value)]"

        query, _ = match_scale(scores.inputs[0])
        concat = producer(query, "Concat")
        if concat is None or concat.attrs.get("axis") not in (-1, 3) or len(concat.inputs) < 2:
            return "the query is not [key part | rotated part]"
        if any(t.shape is None or not isinstance(t.shape[-1], int) for t in concat.inputs[1:]) \
                or not concat.inputs[0].shape or concat.inputs[0].shape[-1] != nope:
            return "the query's parts are not of static widths"
        rope = sum(t.shape[-1] for t in concat.inputs[1:])

        # kᵀ [B, H, N + R, T], in whatever layout the export assembles it (dynamo scatters into [N + R, H, T, B])
        keys_t = scores.inputs[1]
        keys, key_scale = _scale_on_path(keys_t)
        rotated: list[Cache] = []

        def source(tensor: gs.Tensor) -> bool:
            if tensor is key_part:
                return True
            cache = _cache(graph, tensor) if tensor is not latent.present else None
            if cache is not None and tensor.shape[-1] == rope:
                rotated.append(cache)
                return True
            return False

        walked = _key_sources(keys, source)
        if isinstance(walked, str):
            return walked
        sources, moved = walked
        if len(rotated) != 1 or len(sources) != 2:
            return "the keys are not assembled from the expanded latent and one rotated key head"
        if (rotated[0].past is None) != (latent.past is None):
            return "a past for only one of the latent and the rotated key"
        if keys_t.shape is None or len(keys_t.shape) != 4 or keys_t.shape[-2] != nope + rope:
            return "the keys are not [key part | rotated key]"
        # what the rewrite leaves without readers must have none beside the attention (Shapes aside: a cache's
        # batch and length stay as they were)
        readers = ((latent.present, {id(expand)}), (rotated[0].present, moved), (key_part, moved),
                   (values, {id(context)}))
        if any(n.op != "Shape" and id(n) not in allowed for tensor, allowed in readers for n in tensor.outputs):
            return "the latent, the rotated key or their expansion is read beside the attention"
        if query.shape is None or len(query.shape) != 4 or latent.new.shape is None:
            return "the query's or the new latent's shape is not known"

        return LatentAttention(concat, _reader_on_path(scores, scores.inputs[0], query), scores, key_scale,
                               context, latent, rotated[0],
                               weight.reshape(rank, heads, nope + width), nope,
                               softmax.name.rsplit("/", 1)[0] + "/Absorbed")

    def rewrite(self, graph: gs.Graph, match: LatentAttention) -> None:
        rank, heads, _ = match.up.shape
        nope, rope = match.nope, match.rotated.present.shape[-1]
        joined = rank + rope

        def node(op: str, inputs: list, shape, label: str, dtype=np.float32, **attrs) -> gs.Variable:
            out = gs.Variable(f"{match.name}/{label}", dtype=dtype, shape=shape)
            graph.nodes.append(gs.Node(op, name=f"{match.name}/{label}", attrs=attrs, inputs=inputs, outputs=[out]))
            return out

        def constant(label: str, value: np.ndarray) -> gs.Constant:
            return gs.Constant(f"{match.name}/{label}", np.ascontiguousarray(value))

        def heads_round_trip(tensor: gs.Tensor, count: int, label: str) -> tuple[gs.Tensor, gs.Tensor]:
            """([B, S, count·D], [B, count, S, D]) of [B, count, S, D]: the projection and heads the fusion reads."""
            b, _, s, d = tensor.shape
            moved = node("Transpose", [tensor], [b, s, count, d], f"{label}_tokens_first", perm=[0, 2, 1, 3])
            flat = node("Reshape", [moved, constant(f"{label}_flat_shape", np.array([0, 0, -1], np.int64))],
                        [b, s, count * d], f"{label}_flat")
            split = node("Reshape", [flat, constant(f"{label}_heads_shape", np.array([0, 0, count, d], np.int64))],
                         [b, s, count, d], f"{label}_split")
            return flat, node("Transpose", [split], [b, count, s, d], f"{label}_heads", perm=[0, 2, 1, 3])

        # the query: its unrotated part through each head's key columns of W, beside its rotated part
        query = match.query.outputs[0]
        batch, _, tokens, _ = query.shape
        absorbed = node("MatMul", [match.query.inputs[0], constant("key_up", match.up[:, :, :nope].transpose(1, 2, 0))],
                        [batch, heads, tokens, rank], "query_latent")
        joined_query = node("Concat", [absorbed, *match.query.inputs[1:]], [batch, heads, tokens, joined],
                            "query", axis=-1)
        _, query_heads = heads_round_trip(joined_query, heads, "query")
        reader = match.query_reader
        reader.inputs[[i for i, t in enumerate(reader.inputs) if t is query][0]] = query_heads
        if reader is not match.scores:  # a scale on the way: its output is the joined query's shape
            reader.outputs[0].shape = list(query_heads.shape)

        # one key head [c | r] a token, the values too; the cache inputs and outputs take it
        new_shape = match.latent.new.shape
        joined_new = node("Concat", [match.latent.new, match.rotated.new], [*new_shape[:3], joined], "key", axis=-1)
        _, key_heads = heads_round_trip(joined_new, 1, "key")
        presents = []
        for cache in (match.latent, match.rotated):
            if cache.past is None:  # only the new tokens' keys and values
                presents.append(key_heads)
                continue
            cache.past.shape = [*cache.past.shape[:3], joined]
            old = cache.present
            present = gs.Variable(old.name, dtype=old.dtype, shape=[*old.shape[:3], joined])
            old.name = f"{old.name}/expanded"
            graph.nodes.append(gs.Node("Concat", name=f"{match.name}/{present.name}", attrs={"axis": -2},
                                       inputs=[cache.past, key_heads], outputs=[present]))
            graph.outputs = [present if t is old else t for t in graph.outputs]
            for reader in [n for n in old.outputs if n.op == "Shape"]:  # its batch and tokens are the same
                reader.inputs[0] = present
            presents.append(present)
        transposed = node("Transpose", [presents[0]], [batch, 1, joined, presents[0].shape[2]], "keys_t",
                          perm=[0, 1, 3, 2])
        if match.key_scale != 1.0:
            transposed = node("Mul", [transposed, constant("key_scale", np.array(match.key_scale, np.float32))],
                              transposed.shape, "keys_t_scaled")
        match.scores.inputs[1] = transposed
        match.context.inputs[1] = presents[1]

        # each head's output: the first L columns of its attention output, through its value columns of W
        output = match.context.outputs[0]
        attended = gs.Variable(f"{match.name}/attended", dtype=output.dtype, shape=[batch, heads, tokens, joined])
        match.context.outputs[0] = attended
        moved = node("Transpose", [attended], [batch, tokens, heads, joined], "output_tokens_first", perm=[0, 2, 1, 3])
        merged = node("Reshape", [moved, constant("output_flat_shape", np.array([0, 0, -1], np.int64))],
                      [batch, tokens, heads * joined], "output_merged")
        split = node("Reshape", [merged, constant("output_heads_shape", np.array([0, 0, heads, joined], np.int64))],
                     [batch, tokens, heads, joined], "output_split")
        latent = node("Slice", [split, constant("latent_start", np.array([0], np.int64)),
                                constant("latent_end", np.array([rank], np.int64)),
                                constant("latent_axis", np.array([-1], np.int64))],
                      [batch, tokens, heads, rank], "output_latent")
        latent_heads = node("Transpose", [latent], [batch, heads, tokens, rank], "output_heads", perm=[0, 2, 1, 3])
        output.inputs.clear()
        graph.nodes.append(gs.Node("MatMul", name=f"{match.name}/value_up", outputs=[output], inputs=[
            latent_heads, constant("value_up", match.up[:, :, nope:].transpose(1, 0, 2))]))
