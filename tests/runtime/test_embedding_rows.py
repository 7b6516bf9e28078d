"""Token embeddings read with pread outside onnxruntime (cann_llm/runtime/embedding_rows.py): the rows equal the
table's, the graph onnxruntime gets has no Gather of the table (and no table unless a tied head reads it),
the executor's outputs equal onnxruntime on the original export, and ids outside the vocabulary are a
coded refusal instead of a read past the table."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import compile_to, ort_reference

from cann_llm.models.tiny import tiny_onnx
from cann_llm.runtime.embedding_rows import TableRows, split_off
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.loader import load_artifact


@pytest.fixture(scope="module", params=["llama", "llama_tied"])
def compiled(request, tmp_path_factory):
    source = tiny_onnx(request.param, dynamo=False, with_past=True)
    return request.param, source, load_artifact(compile_to(source, tmp_path_factory.mktemp(request.param) / "m"))


def _table(loaded):
    name = next(node.input[0] for node in loaded.model.graph.node if node.op_type == "Gather"
                and node.input[0] in loaded.weights and node.input[1] == "input_ids")
    return name, loaded.weights[name]


def test_rows_are_the_tables_and_out_of_range_ids_are_refused(compiled):
    _, _, loaded = compiled
    name, table = _table(loaded)
    _, (gathered,) = split_off(loaded.model, loaded.weights, loaded.om)
    assert gathered.indices == "input_ids"

    def rows(ids):
        values = {"input_ids": ids}
        gathered.feed(values)
        return values[gathered.output]

    ids = np.array([[0, 5, 5, table.shape[0] - 1, -1], [17, 0, 200, -table.shape[0], 5]], np.int64)
    got = rows(ids)
    assert got.shape == (2, 5, table.shape[1]) and got.dtype == table.dtype
    np.testing.assert_array_equal(got, np.take(table, ids, axis=0))
    assert rows(np.zeros((1, 0), np.int64)).shape == (1, 0, table.shape[1])
    for bad in (table.shape[0], -table.shape[0] - 1):
        with pytest.raises(AtcError) as refused:
            rows(np.array([[3, bad]], np.int64))
        assert refused.value.code == "E10001" and str(bad) in str(refused.value)
    for wrong in (np.array([[1.5]], np.float32), np.array([[1]], np.int32), np.array([[1]], np.uint64)):
        with pytest.raises(AtcError, match=f"E10001.*{wrong.dtype}.*input_ids needs int64"):
            rows(wrong)


def test_a_short_file_is_refused_not_read_as_garbage(tmp_path):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    (tmp_path / "t.bin").write_bytes(b"\0" * 16 + table.tobytes())
    rows = TableRows(str(tmp_path / "t.bin"), 16, "t", (20, 4), np.dtype(np.float32))
    np.testing.assert_array_equal(rows(np.array([9, 0], np.int64)), table[[9, 0]])
    with pytest.raises(AtcError, match="E13015.*row 15 of t lies past the end of the file"):
        rows(np.array([15], np.int64))


def test_the_session_graph_reads_no_table_rows(compiled):
    _, _, loaded = compiled
    name, _ = _table(loaded)
    model, readers = split_off(loaded.model, loaded.weights, loaded.om)
    assert [r.output for r in readers] == [n.output[0] for n in loaded.model.graph.node if n.op_type == "Gather"
                                           and n.input[0] == name]
    assert not [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == name]
    assert readers[0].output in {value.name for value in model.graph.input}
    assert len(model.graph.node) == len(loaded.model.graph.node) - 1
    # the table leaves the session (exporters fold a small tied head's transpose into a copy of its own)
    assert name not in {t.name for t in model.graph.initializer}
    # a node still reading the table (a large tied head's Transpose is left to onnxruntime) keeps it there
    tied = onnx.ModelProto()
    tied.CopyFrom(loaded.model)
    tied.graph.node.append(onnx.helper.make_node("Transpose", [name], ["head_weight"], perm=[1, 0]))
    tied.graph.output.append(onnx.helper.make_tensor_value_info("head_weight", onnx.TensorProto.FLOAT, None))
    model, _ = split_off(tied, loaded.weights, loaded.om)
    assert name in {t.name for t in model.graph.initializer}
    # and so does a branch of an If reading it from the outer graph
    branch = onnx.helper.make_graph([onnx.helper.make_node("Identity", [name], ["branch_out"])], "branch", [],
                                    [onnx.helper.make_tensor_value_info("branch_out", onnx.TensorProto.FLOAT, None)])
    conditional = onnx.ModelProto()
    conditional.CopyFrom(loaded.model)
    conditional.graph.input.append(onnx.helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []))
    conditional.graph.node.append(onnx.helper.make_node("If", ["flag"], ["chosen"], then_branch=branch,
                                                         else_branch=branch))
    conditional.graph.output.append(onnx.helper.make_tensor_value_info("chosen", onnx.TensorProto.FLOAT, None))
    model, _ = split_off(conditional, loaded.weights, loaded.om)
    assert name in {t.name for t in model.graph.initializer}


def test_outputs_equal_onnxruntime_on_the_export(compiled):
    _, source, loaded = compiled
    executor = Executor(loaded)
    dims = loaded.metadata["model"]
    for batch, seq, past, seed in ((2, 6, 3, 0), (1, 1, 7, 1)):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, dims["vocab_size"], (batch, seq), dtype=np.int64)
        feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, past, rng)
        want, got = ort_reference(source, feeds), executor.run(feeds)
        for output in want:
            np.testing.assert_allclose(got[output], want[output], rtol=0, atol=1e-4, err_msg=output)
