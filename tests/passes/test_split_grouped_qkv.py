"""GroupedQkvSplitPass on the attention projections of the remote-code families users export with
`trust_remote_code` (no transformers class to build them from here): Baichuan's `W_pack` and InternLM2's
`wqkv`, each module's forward written as its modeling file writes it, exported by PyTorch's two exporters.
The pass reorders the projection into [q | k | v] blocks and onnxruntime gives the same heads before and
after. (Falcon, whose transformers class packs the same way, runs end to end in
tests/test_architecture_variants.py.)"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from fusion_utils import apply_pass, run_original

from cann_llm.passes.eliminate_identity import EliminateIdentity
from cann_llm.passes.fold_constants import FoldConstants
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.split_grouped_qkv import SplitGroupedQkv

HIDDEN, HEADS, KV_HEADS, DIM = 64, 4, 2, 16


def _baichuan():
    import torch

    class Attention(torch.nn.Module):
        """Baichuan-7B's and Baichuan2's: one W_pack, cut into three along a leading axis."""

        def __init__(self):
            super().__init__()
            self.W_pack = torch.nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)

        def forward(self, hidden_states):
            bsz, q_len, _ = hidden_states.size()
            proj = self.W_pack(hidden_states)
            proj = proj.unflatten(-1, (3, HIDDEN)).unsqueeze(0).transpose(0, -2).squeeze(-2)
            query_states = proj[0].view(bsz, q_len, HEADS, DIM).transpose(1, 2)
            key_states = proj[1].view(bsz, q_len, HEADS, DIM).transpose(1, 2)
            value_states = proj[2].view(bsz, q_len, HEADS, DIM).transpose(1, 2)
            return query_states, key_states, value_states

    return Attention()


def _internlm2():
    import torch

    groups = HEADS // KV_HEADS

    class Attention(torch.nn.Module):
        """InternLM2's: wqkv packed by KV group, each group's queries then its key and value (einops'
        rearranges as the reshapes they are on torch tensors)."""

        def __init__(self):
            super().__init__()
            self.wqkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, bias=True)

        def forward(self, hidden_states):
            bsz, q_len, _ = hidden_states.size()
            qkv_states = self.wqkv(hidden_states)
            qkv_states = qkv_states.reshape(bsz, q_len, KV_HEADS, 2 + groups, DIM)  # b q (h gs d) -> b q h gs d
            query_states = qkv_states[..., :groups, :]
            query_states = query_states.reshape(bsz, q_len, HEADS, DIM)  # b q h gs d -> b q (h gs) d
            key_states = qkv_states[..., -2, :]
            value_states = qkv_states[..., -1, :]
            return query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2)

    return Attention()


def _export(module, path, dynamo: bool) -> onnx.ModelProto:
    import torch

    torch.manual_seed(0)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter)
    sample = (torch.randn(2, 5, HIDDEN),)
    if dynamo:
        dim = torch.export.Dim.DYNAMIC
        torch.onnx.export(module, sample, path, input_names=["hidden"], dynamic_shapes=({0: dim, 1: dim},),
                          dynamo=True, optimize=True)
    else:
        torch.onnx.export(module, sample, path, input_names=["hidden"], output_names=["q", "k", "v"],
                          dynamic_axes={"hidden": {0: "batch", 1: "seq"}}, dynamo=False, opset_version=17)
    return onnx.load(path)


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("family", ["baichuan", "internlm2"])
def test_projections_cut_by_regrouping_become_three_blocks(family, dynamo, tmp_path):
    model = _export(_baichuan() if family == "baichuan" else _internlm2(), tmp_path / "attention.onnx", dynamo)
    # the pipeline's canonical form first: TorchScript's Slice bounds are computed until folded
    rewritten, (*_, result) = apply_pass(model, FoldConstants(), EliminateIdentity(), InferShapes(), FoldConstants(),
                                         SplitGroupedQkv())
    assert result.effect_times == 1, result.rejections
    ops = Counter(n.op_type for n in rewritten.graph.node)
    assert ops["MatMul"] == 1 and ops["Slice"] == 3 and ops["Gather"] == ops["Split"] == ops["Squeeze"] == 0, ops
    feeds = {"hidden": np.random.default_rng(0).standard_normal((3, 7, HIDDEN)).astype(np.float32)}
    for want, got in zip(run_original(model, feeds), run_original(rewritten, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _hand_built(tokens_swapped: bool = False, sizes_computed: bool = False, optimum_falcon: bool = False) -> gs.Graph:
    """x·W reshaped to [B, S, 12, D] by a target read from x's shape, then split into three by 4 heads, each
    read by the head transpose; the shapes set as inference would. `optimum_falcon`: as transformers 4.57's
    Falcon writes it, the queries' shape is read too and the key is broadcast to its own shape."""
    x = gs.Variable("x", np.float32, ["B", "S", HIDDEN])
    weight = gs.Constant("W", np.random.default_rng(0).standard_normal((HIDDEN, 12 * DIM)).astype(np.float32))
    projected = gs.Variable("p", np.float32, ["B", "S", 12 * DIM])
    dims, first, second = (gs.Variable(n, np.int64, s) for n, s in (("dims", [3]), ("d0", [1]), ("d1", [1])))
    target = gs.Variable("target", np.int64, [4])
    heads = gs.Variable("heads", np.float32, ["S", "B", 12, DIM] if tokens_swapped else ["B", "S", 12, DIM])
    pieces = [gs.Variable(f"piece{i}", np.float32, [*heads.shape[:2], 4, DIM]) for i in range(3)]
    outputs = [gs.Variable(n, np.float32, [heads.shape[0], 4, heads.shape[1], DIM]) for n in "qkv"]
    sizes = gs.Variable("sizes", np.int64, [3]) if sizes_computed else gs.Constant("sizes", np.array([4, 4, 4]))
    nodes = [gs.Node("MatMul", inputs=[x, weight], outputs=[projected]),
             gs.Node("Shape", inputs=[x], outputs=[dims]),
             gs.Node("Gather", attrs={"axis": 0}, inputs=[dims, gs.Constant("i0", np.array([0]))], outputs=[first]),
             gs.Node("Gather", attrs={"axis": 0}, inputs=[dims, gs.Constant("i1", np.array([1]))], outputs=[second]),
             gs.Node("Concat", attrs={"axis": 0}, outputs=[target], inputs=[
                 *([second, first] if tokens_swapped else [first, second]), gs.Constant("hd", np.array([12, DIM]))]),
             gs.Node("Reshape", inputs=[projected, target], outputs=[heads]),
             gs.Node("Split", attrs={"axis": 2}, inputs=[heads, sizes], outputs=pieces)]
    if optimum_falcon:
        broadcast = gs.Variable("broadcast", np.float32, pieces[1].shape)
        measured = gs.Variable("measured", np.int64, [4])
        nodes += [gs.Node("Expand", inputs=[pieces[1], gs.Constant("ones", np.array([1, 1, 4, DIM]))],
                          outputs=[broadcast]),
                  gs.Node("Shape", inputs=[pieces[0]], outputs=[measured])]
        pieces = [pieces[0], broadcast, pieces[2]]
    nodes += [gs.Node("Transpose", attrs={"perm": [0, 2, 1, 3]}, inputs=[p], outputs=[o]) for p, o in zip(pieces, outputs)]
    inputs = [x, sizes] if sizes_computed else [x]
    return gs.Graph(nodes=nodes, inputs=inputs, outputs=outputs + ([measured] if optimum_falcon else []), opset=17)


@pytest.mark.parametrize("optimum_falcon", [False, True])
def test_token_axes_swapped_or_split_sizes_known_only_at_run_time_are_refused(optimum_falcon):
    plain = _hand_built(optimum_falcon=optimum_falcon)
    original = gs.export_onnx(plain.copy())
    assert SplitGroupedQkv().run(plain).effect_times == 1  # the control: the same graph otherwise
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    for want, got in zip(run_original(original, feeds), run_original(gs.export_onnx(plain), feeds)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for refused in (_hand_built(tokens_swapped=True), _hand_built(sizes_computed=True)):
        result = SplitGroupedQkv().run(refused)
        assert result.effect_times == 0 and any("does not cut heads" in r for r in result.rejections), result
