"""Pipeline parallelism (`atc --pipeline_stages=K`, cann_llm/runtime/engine/pipeline.py): a 3-layer tiny model split
into 2 and 3 stage artifacts, each run by a Ray actor of its own (a local Ray instance started by the
engine), generates exactly the tokens the single artifact does, in batches cut into micro-batches, with
prefix-cache page copies, across the spellings that matter (both exporters, Qwen3's per-head norms,
Gemma's scaled embedding); what cannot be split or run is refused with a code."""

from __future__ import annotations

import os

import pytest
from conftest import compile_to

from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.errors import AtcError

PROMPTS = [[5, 17, 99, 3, 42, 8, 200, 31], [7] * 40, [1, 2, 3], list(range(60, 150))]
NEW_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    """The engine starts Ray in this process; it is stopped with the module, not left to the next one."""
    yield
    import ray

    ray.shutdown()


def _export(family: str, dynamo: bool):
    from cann_llm.models.tiny import tiny_onnx

    return tiny_onnx(family, dynamo=dynamo, with_past=True, overrides={"num_hidden_layers": 3})


def _generate(om, prompts) -> list[list[int]]:
    with LLMEngine(om, max_context_len=256, kv_cache_pages=16, threads=1) as engine:
        outputs = engine.generate(prompts, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        # one after another: the second reuses the first's cached prefix (a page copy within a page)
        shared = [engine.generate([p], max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)[0]
                  for p in ([9] * 20 + [4], [9] * 20 + [6, 6])]
        hits = engine.blocks.prefix_hits
    return [list(o.outputs[0].token_ids) for o in (*outputs, *shared)], hits


@pytest.mark.parametrize("family,dynamo,stages", [("llama", True, 2), ("llama", True, 3), ("qwen3", True, 2),
                                                  ("gemma", False, 3)])
def test_stages_in_their_own_processes_generate_what_the_whole_model_does(tmp_path, family, dynamo, stages):
    model = _export(family, dynamo)
    whole = compile_to(model, tmp_path / "whole", enable_paged_attention=True)
    first = compile_to(model, tmp_path / "split", enable_paged_attention=True, pipeline_stages=stages)
    assert first == tmp_path / "split_stage0.om"
    layers = []
    for index in range(stages):
        metadata = OmFile(tmp_path / f"split_stage{index}.om").metadata
        assert metadata["pipeline"]["stage"] == index and metadata["pipeline"]["num_layers"] == 3
        layers.append(tuple(metadata["pipeline"]["layers"]))
        assert metadata["model"]["num_layers"] == layers[-1][1] - layers[-1][0]
    assert layers == ([(0, 2), (2, 3)] if stages == 2 else [(0, 1), (1, 2), (2, 3)])
    expected, expected_hits = _generate(whole, PROMPTS)
    got, hits = _generate(first, PROMPTS)
    assert got == expected and hits == expected_hits > 0


def test_each_stage_runs_in_a_process_of_its_own(tmp_path):
    first = compile_to(_export("llama", True), tmp_path / "split", enable_paged_attention=True, pipeline_stages=3)
    with LLMEngine(first, max_context_len=64, kv_cache_pages=4, threads=1) as engine:
        pids = [process["pid"] for process in engine.runner.processes]
    assert len(set(pids)) == 3 and os.getpid() not in pids


def test_what_cannot_be_split_or_run_is_refused(tmp_path):
    model = _export("llama", True)
    with pytest.raises(AtcError, match="E10055.*--enable_paged_attention=1"):
        compile_to(model, tmp_path / "contiguous", pipeline_stages=2)
    with pytest.raises(AtcError, match="E10001.*The model has 3 layers; give 2 to 3 stages"):
        compile_to(model, tmp_path / "many", enable_paged_attention=True, pipeline_stages=4)
    assert not list(tmp_path.glob("many*.om")) and not list(tmp_path.glob("contiguous*.om"))
    compile_to(model, tmp_path / "split", enable_paged_attention=True, pipeline_stages=2)
    with pytest.raises(AtcError, match="E10001.*stage 1 of a pipeline: run its first stage, split_stage0.om"):
        LLMEngine(tmp_path / "split_stage1.om")
    (tmp_path / "split_stage1.om").unlink()
    with pytest.raises(AtcError, match="E13001.*split_stage1.om"):
        LLMEngine(tmp_path / "split_stage0.om")


def test_a_tied_head_is_stored_transposed_in_blocks_in_the_last_stage(tmp_path):
    """A table over the folding threshold reaches the artifact as the embedding plus a Transpose for the head.
    The last stage, which has no embedding, stores the head transposed in blocks (onnxruntime would fold the
    transpose and pre-pack the whole head at once while building the session: the stage's peak)."""
    from cann_llm.models.tiny import tiny_onnx
    from cann_llm.passes.pipeline_stages import WEIGHT_BLOCK_BYTES

    vocab = 70_000  # × 64 float32: 17.9 MB, over the 16 MB folding threshold and one block
    model = tiny_onnx("llama_tied", dynamo=True, with_past=True, overrides={"num_hidden_layers": 3, "vocab_size": vocab})
    whole = compile_to(model, tmp_path / "whole", enable_paged_attention=True)
    compile_to(model, tmp_path / "split", enable_paged_attention=True, pipeline_stages=2)
    graph = OmFile(whole).graph().graph
    assert [node.op_type for node in graph.node].count("Transpose") == 1
    last = OmFile(tmp_path / "split_stage1.om")
    graph = last.graph().graph
    blocks = [node for node in graph.node if node.op_type == "MatMul" and "_transposed_" in node.input[1]]
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    assert "Transpose" not in {node.op_type for node in graph.node}
    assert len(blocks) == 2 and all(shapes[node.input[1]][1] * 64 * 4 <= WEIGHT_BLOCK_BYTES for node in blocks)
    assert sum(shapes[node.input[1]][1] for node in blocks) == vocab
    assert all(shapes[node.input[1]][0] == 64 for node in blocks)
    prompts = [[5, 17, 99, 3, 42, 8, 200, 31], [69_999, 1, 2]]
    assert _generate(tmp_path / "split_stage0.om", prompts) == _generate(whole, prompts)
