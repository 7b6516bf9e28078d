"""The .om format: layout, zero-copy weights, determinism, and refusal of damaged files."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from cann_llm.runtime.artifact import ALIGN, HEADER_SIZE, OmFile, write_artifact
from cann_llm.runtime.errors import AtcError

pytestmark = pytest.mark.unit


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((300, 4)).astype(np.float32), "weight")
    other = numpy_helper.from_array(rng.standard_normal((4, 200)).astype(np.float16), "other")
    bias = numpy_helper.from_array(np.arange(4, dtype=np.float32), "bias")
    nodes = [helper.make_node("MatMul", ["x", "weight"], ["y"]), helper.make_node("Add", ["y", "bias"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 300])],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 4])],
                              [weight, other, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "m.om"
    write_artifact(path, _model(), {"name": "m", "soc_version": "Ascend910B"}, {"tokenizer.json": "{}"})
    return path


def test_header_follows_atc_layout(written):
    data = written.read_bytes()
    assert data[:4] == b"IMOD"
    magic, headsize, version = struct.unpack_from("<III", data)
    assert (magic, headsize, version) == (0x444F4D49, 256, 0x20000000)
    assert data[84:85] == b"m"
    (model_length,) = struct.unpack_from("<Q", data, 184)
    assert model_length == len(data) - HEADER_SIZE
    (count,) = struct.unpack_from("<I", data, HEADER_SIZE)
    assert count == 4


def test_round_trip_gives_the_same_graph_weights_and_metadata(written):
    om = OmFile(written)
    original = _model()
    model = om.graph()
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add"]
    weights = om.weights(model)
    assert sorted(weights) == ["other", "weight"]  # the 16-byte bias stays inline
    for tensor in original.graph.initializer:
        expected = numpy_helper.to_array(tensor)
        if tensor.name in weights:
            np.testing.assert_array_equal(weights[tensor.name], expected)
            assert weights[tensor.name].dtype == expected.dtype
            assert not weights[tensor.name].flags.writeable
    assert om.metadata == {"name": "m", "soc_version": "Ascend910B"}
    assert om.tokenizer_files() == {"tokenizer.json": "{}"}
    assert om.header.soc_version == "Ascend910B"


def test_weights_are_64_byte_aligned_in_the_file(written):
    om = OmFile(written)
    model = om.graph()
    base = np.frombuffer(om._mm, dtype=np.uint8).ctypes.data
    for name, view in om.weights(model).items():
        assert (view.ctypes.data - base) % ALIGN == 0, name


def test_same_inputs_give_identical_bytes(tmp_path):
    meta = {"name": "m", "soc_version": "Ascend910B"}
    write_artifact(tmp_path / "a.om", _model(), meta)
    write_artifact(tmp_path / "b.om", _model(), meta)
    assert (tmp_path / "a.om").read_bytes() == (tmp_path / "b.om").read_bytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_weights_detached_from_the_graph_are_written_byte_for_byte_as_inline_ones(tmp_path, dtype):
    import onnx_graphsurgeon as gs

    from cann_llm.passes.weight_memory import detach_weights

    def graph():  # arrays of the compiler's making, as a pass leaves them
        made = gs.import_onnx(_model())
        for constant in made.tensors().values():
            if isinstance(constant, gs.Constant):
                constant.values = np.array(constant.values, dtype if constant.name == "weight" else None)
        return made

    meta = {"name": "m", "soc_version": "Ascend910B"}
    write_artifact(tmp_path / "inline.om", gs.export_onnx(graph(), do_type_check=False), meta)
    detached_graph = graph()
    detached = detach_weights(detached_graph)
    assert sorted(detached) == ["weight"]  # bias is under EXTERNAL_MIN_BYTES and stays inline
    exported = gs.export_onnx(detached_graph, do_type_check=False)
    assert not next(t for t in exported.graph.initializer if t.name == "weight").raw_data
    write_artifact(tmp_path / "detached.om", exported, meta, detached=detached)
    assert (tmp_path / "detached.om").read_bytes() == (tmp_path / "inline.om").read_bytes()


def _damage(path, offset: int | None = None, truncate: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    if truncate is not None:
        data = data[:truncate]
    if offset is not None:
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    (dict(truncate=-10), "truncated"),
    (dict(truncate=100), "less than the 256-byte header"),
    (dict(offset=-1), "corrupted"),
    (dict(offset=0), "magic"),
    (dict(offset=HEADER_SIZE + 12), "partition table is corrupted"),
])
def test_damaged_files_are_refused_with_the_reason(written, damage, words):
    size = written.stat().st_size
    if damage.get("truncate", 0) < 0:
        damage = {"truncate": size + damage["truncate"]}
    if damage.get("offset", 0) < 0:
        damage = {"offset": size + damage["offset"] - 200}
    _damage(written, **damage)
    with pytest.raises(AtcError) as caught:
        OmFile(written)
    assert caught.value.code == "E13015"
    assert words in caught.value.message


def test_each_corrupted_partition_is_named(written):
    om = OmFile(written)
    spans = {kind: om._partitions[kind][:2] for kind in om._partitions}
    for kind, (start, length) in spans.items():
        copy = written.with_name(f"{kind.name}.om")
        copy.write_bytes(written.read_bytes())
        _damage(copy, offset=start + length // 2)
        with pytest.raises(AtcError) as caught:
            OmFile(copy)
        assert f"the {kind.name} partition is corrupted" in caught.value.message


def test_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "model.om"
    for content, words in ((_model().SerializeToString(), "it is an ONNX model, not an offline model"),
                           (b"GGUF" + bytes(300), "it is not an offline model: magic 0x46554747")):
        path.write_bytes(content)
        with pytest.raises(AtcError) as caught:
            OmFile(path)
        assert caught.value.code == "E13015" and words in caught.value.message


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(AtcError) as caught:
        OmFile(tmp_path / "absent.om")
    assert caught.value.code == "E13001"


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    target = tmp_path / "m.om"
    target.mkdir()  # the final rename fails after every byte was written
    with pytest.raises(AtcError, match="E13004"):
        write_artifact(target, _model(), {"name": "m"})
    assert [p.name for p in tmp_path.iterdir()] == ["m.om"] and target.is_dir()
