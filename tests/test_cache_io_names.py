"""Exports whose cache inputs and present outputs carry the exporter's own names, as users' exports do when
they give no `input_names`/`output_names` (`past.1`, `past_0`, `key.3`) or export with transformers' own
ONNX exporter (`past_key_values.layers.0.keys`): CausalLmIoNamingPass reads which input is which layer's
keys or values from the graph, so each compiles contiguous and paged and generates transformers' greedy
tokens. An artifact the engine cannot feed, or whose cache it cannot carry, is refused at load (E10055)."""

from __future__ import annotations

from collections import Counter

import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from cann_llm import CompileConfig, LLMEngine, compile_model
from cann_llm.models.export import _CausalLMWithFlatCache, example_inputs
from cann_llm.models.tiny import build_tiny_model, tiny_onnx
from cann_llm.passes.infer_shapes import InferShapes
from cann_llm.passes.name_causal_lm_io import NameCausalLmIo
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.loader import load_artifact
from tests.generation_utils import engine_greedy, hf_greedy

PROMPTS = [[5, 17, 42, 99, 3, 150], [7, 120, 33]]
NEW_TOKENS = 12
CACHE_NAMES = [f"past_key_values.{layer}.{kind}" for layer in range(2) for kind in ("key", "value")]


def _compile(source, output, **flags):
    config = CompileConfig(model=str(source), framework=5, output=str(output), soc_version="Ascend910B", **flags)
    return compile_model(config).output


class _Reversed(torch.nn.Module):
    """The flat cache taken in reverse (last layer's values first), as no exporter orders it."""

    def __init__(self, wrapper: torch.nn.Module):
        super().__init__()
        self.wrapper = wrapper

    def forward(self, input_ids, attention_mask, position_ids, *past):
        return self.wrapper(input_ids, attention_mask, position_ids, *past[::-1])


def _export_unnamed(path, dynamo: bool, family: str = "llama", reverse: bool = False, opset: int | None = None):
    """The tiny model with its cache flattened, exported with no names (dynamo) or with its cache inputs
    named `cache.N` (TorchScript, whose dynamic axes need input names): the cache inputs and every output
    keep names the engine cannot read."""
    model = build_tiny_model(family).eval()
    feeds = example_inputs(model.config, with_past=True)
    args = tuple(feeds.values())
    wrapper = _CausalLMWithFlatCache(model, with_past=True).eval()
    if reverse:
        wrapper, args = _Reversed(wrapper).eval(), args[:3] + args[3:][::-1]
    with torch.no_grad():
        if dynamo:
            dynamic = torch.export.Dim.DYNAMIC
            past = tuple({0: dynamic, 2: dynamic} for _ in args[3:])
            program = torch.onnx.export(wrapper, args, dynamic_shapes=({0: dynamic, 1: dynamic},) * 3 + (past,),
                                        dynamo=True, **({"opset_version": opset} if opset else {}))
            program.save(str(path))
        else:
            cache = [f"cache.{index}" for index in range(len(args) - 3)]
            axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "t"}, "position_ids": {0: "b", 1: "s"},
                    **{name: {0: "b", 2: "p"} for name in cache}}
            torch.onnx.export(wrapper, args, str(path), input_names=["input_ids", "attention_mask", "position_ids", *cache],
                              dynamic_axes=axes, dynamo=False, opset_version=17)
    return path


def _export_with_transformers(path, family: str = "llama", overrides: dict | None = None):
    """transformers' own ONNX exporter (`transformers.exporters`), dynamic shapes, with a cache."""
    exporter_onnx = pytest.importorskip("transformers.exporters.exporter_onnx")
    from transformers import DynamicCache
    from transformers.exporters.configs import OnnxConfig

    model = build_tiny_model(family, overrides=overrides).eval()
    feeds = example_inputs(model.config, with_past=True)
    past = [feeds[name] for name in CACHE_NAMES]
    sample = {name: feeds[name] for name in ("input_ids", "attention_mask", "position_ids")}
    sample.update(past_key_values=DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])), config=model.config),
                  use_cache=True)
    exported = exporter_onnx.OnnxExporter().export(model, sample, config=OnnxConfig(dynamic=True))
    exporter_onnx.OnnxExporter.save_program(exported.program, str(path))
    return path


def _assert_generates_as_transformers(source, tmp_path, family: str = "llama"):
    expected = hf_greedy(family, tuple(map(tuple, PROMPTS)), NEW_TOKENS)
    for paged in (False, True):
        om = _compile(source, tmp_path / ("paged" if paged else "contiguous"), enable_paged_attention=paged)
        loaded = load_artifact(om)
        assert Counter(n.op_type for n in loaded.model.graph.node)["PagedAttention" if paged else "FusedAttention"] == 2
        if not paged:
            signature = loaded.metadata["signature"]
            assert sorted(v["name"] for v in signature["inputs"][3:]) == CACHE_NAMES
            assert sorted(v["name"] for v in signature["outputs"][1:]) == [
                name.replace("past_key_values", "present") for name in CACHE_NAMES]
        assert engine_greedy(om, PROMPTS, NEW_TOKENS) == expected, "paged" if paged else "contiguous"


@pytest.mark.parametrize("dynamo, family, reverse, opset", [
    (False, "llama", False, None), (True, "llama", False, None),
    (False, "llama", True, None),  # in no exporter's order: read from what each input does, not where it stands
    (True, "llama", True, 23),  # ONNX's Attention op, reading the cache concatenated outside it
    (False, "gpt2", False, None),  # Conv1D projections, keys and values split from one
    (False, "mistral", False, None)])  # one KV head broadcast to the query heads
def test_a_cache_the_exporter_named_is_read_by_structure(dynamo, family, reverse, opset, tmp_path):
    source = _export_unnamed(tmp_path / "model.onnx", dynamo, family, reverse, opset)
    if opset:
        assert "Attention" in {node.op_type for node in onnx.load(source, load_external_data=False).graph.node}
    graph = gs.import_onnx(onnx.load(source))
    assert not set(CACHE_NAMES) & {value.name for value in graph.inputs}
    InferShapes().run(graph)
    NameCausalLmIo().run(graph)
    # each input named for what it holds: the reversed export's first cache input is the last layer's values
    assert [value.name for value in graph.inputs[3:]] == (CACHE_NAMES[::-1] if reverse else CACHE_NAMES)
    _assert_generates_as_transformers(source, tmp_path, family=family)


def test_transformers_own_onnx_exporter_fuses_and_generates(tmp_path):
    """Its sdpa zeroes the rows that see no key (`Where(sum(mask) < 1, 0, context)`) between the context and
    the head merge: read as the context, those rows attending to nothing. Its cache is
    `past_key_values.layers.N.keys` in and `cache.layers.N.keys` out."""
    source = _export_with_transformers(tmp_path / "model.onnx")
    _assert_generates_as_transformers(source, tmp_path)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_transformers_own_exporter_on_a_sliding_window_model_is_served(paged, tmp_path):
    """It passes each sliding-window layer's `_sliding_window_tensor` through the graph, input to output:
    state of the cache object that the model never reads, which every compile drops (no runner has anything
    to feed it: the contiguous engine refused the artifact at load)."""
    window = {"sliding_window": 4}
    source = _export_with_transformers(tmp_path / "model.onnx", "mistral", window)
    carried = [i.name for i in onnx.load(source, load_external_data=False).graph.input if "_sliding_window" in i.name]
    assert carried
    om = _compile(source, tmp_path / "om", enable_paged_attention=paged)
    signature = load_artifact(om).metadata["signature"]
    assert not [v["name"] for v in signature["inputs"] + signature["outputs"] if "_sliding_window" in v["name"]]
    assert engine_greedy(om, PROMPTS, NEW_TOKENS) == hf_greedy("mistral", tuple(map(tuple, PROMPTS)), NEW_TOKENS,
                                                               window)


def test_initializers_kept_as_inputs_compile(tmp_path):
    """`torch.onnx.export(..., keep_initializers_as_inputs=True)` lists every weight as a graph input too."""
    model = build_tiny_model("llama").eval()
    feeds = example_inputs(model.config, with_past=False)
    names = ["input_ids", "attention_mask", "position_ids"]
    axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}, "position_ids": {0: "b", 1: "s"}}
    source = tmp_path / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(_CausalLMWithFlatCache(model, with_past=False).eval(), tuple(feeds[n] for n in names),
                          str(source), input_names=names, output_names=["logits"], dynamic_axes=axes,
                          keep_initializers_as_inputs=True, dynamo=False, opset_version=17)
    graph = onnx.load(source).graph
    assert {t.name for t in graph.initializer} <= {v.name for v in graph.input}
    om = _compile(source, tmp_path / "paged", enable_paged_attention=True)
    assert engine_greedy(om, PROMPTS, NEW_TOKENS) == hf_greedy("llama", tuple(map(tuple, PROMPTS)), NEW_TOKENS)


def _edited(source, path, edit) -> str:
    model = onnx.load(source)
    edit(model.graph)
    onnx.save(model, path)
    return str(path)


def _refusal_at_load(source, tmp_path) -> str:
    """What LLMEngine says (E10055) refusing `source` compiled contiguous."""
    om = _compile(source, tmp_path / "contiguous")
    with pytest.raises(AtcError) as refused:
        LLMEngine(om)
    assert refused.value.code == "E10055"
    return str(refused.value)


def _positions_as_cache_position(graph):
    for value in graph.input:
        if value.name == "position_ids":
            value.name = "cache_position"
    for node in graph.node:
        node.input[:] = ["cache_position" if name == "position_ids" else name for name in node.input]


def _logits_alone(graph):
    del graph.output[1:]


@pytest.mark.parametrize("edit, said", [
    (_positions_as_cache_position, "takes inputs the engine does not feed: cache_position"),
    # a cache taken in and the logits alone given back: each step would start from no cache
    (_logits_alone, "gives no present.0.key output")])
def test_an_artifact_the_engine_cannot_feed_or_carry_is_refused_at_load(edit, said, tmp_path):
    source = _edited(tiny_onnx("llama", dynamo=False, with_past=True), tmp_path / "model.onnx", edit)
    assert said in _refusal_at_load(source, tmp_path)


def test_a_cache_of_one_fixed_length_is_refused_at_load(tmp_path):
    """TorchScript with `dynamic_axes` for the named token inputs alone folds the cache's traced length (3)
    into the graph: the engine, whose cache grows a token a step, refuses it and says how to export it."""
    model = build_tiny_model("llama").eval()
    args = tuple(example_inputs(model.config, with_past=True).values())
    names = ["input_ids", "attention_mask", "position_ids"]
    axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "t"}, "position_ids": {0: "b", 1: "s"}}
    source = tmp_path / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(_CausalLMWithFlatCache(model, with_past=True).eval(), args, str(source), input_names=names,
                          dynamic_axes=axes, dynamo=False, opset_version=17)
    assert "of the one past length 3" in _refusal_at_load(source, tmp_path)
