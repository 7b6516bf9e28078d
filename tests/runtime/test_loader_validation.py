"""Crafted `.om` files, every checksum valid, are refused by the loader with E13015 naming the field.

Each case takes a real compiled artifact apart (cann_llm/runtime/artifact.py's reader), changes one thing and puts it
back together through the writer or, for the container itself, a packer that lays partitions out as the
writer does and recomputes their CRCs and the table's SHA-256: what the loader sees is a file only a
deliberate hand could have made.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import compile_to
from onnx import helper

from cann_llm.runtime.artifact import (
    _ENTRY, _TABLE_HEAD, HEADER_SIZE, OmFile, Partition, _align, _pack_header, write_artifact,
)
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact


@pytest.fixture(scope="module")
def contiguous_om(tmp_path_factory, tiny_llama_path) -> Path:
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "contiguous")


@pytest.fixture(scope="module")
def paged_om(tmp_path_factory, tiny_llama_path) -> Path:
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "paged", enable_paged_attention=True)


@pytest.fixture(scope="module")
def int4_om(tmp_path_factory, tiny_llama_path) -> Path:
    return compile_to(tiny_llama_path, tmp_path_factory.mktemp("om") / "int4", enable_compress_weight=True)


def _rewrite(source: Path, target: Path, edit) -> Path:
    """`source` with `edit(model, metadata, tokenizer_files)` applied, written by the artifact writer."""
    om = OmFile(source)
    model, metadata, files = om.graph(), om.metadata, om.tokenizer_files()
    weights = {name: view.copy() for name, view in om.weights(model).items()}
    edit(model, metadata, files)
    write_artifact(target, model, metadata, files, detached=weights)
    return target


def _set_attribute(op_type: str, name: str, value, index: int = 0):
    def edit(model, metadata, files):
        node = [n for n in model.graph.node if n.op_type == op_type][index]
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(name, value)])
    return edit


def _set_metadata(path: tuple, value):
    def edit(model, metadata, files):
        target = metadata
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def _set_tokenizer(name: str, text: str):
    def edit(model, metadata, files):
        files[name] = text
    return edit


def _pack(target: Path, parts: list[tuple[int, bytes]], offsets: dict[int, int] | None = None) -> Path:
    """Partitions laid out as the writer lays them, CRCs and the table's SHA-256 recomputed; `offsets`
    overrides the table's offset of a partition kind."""
    table_end = HEADER_SIZE + _TABLE_HEAD.size + _ENTRY.size * len(parts)
    out, entries = bytearray(_align(table_end)), []
    for kind, data in parts:
        start = _align(len(out))
        out += b"\0" * (start - len(out)) + data
        offset = (offsets or {}).get(kind, start - table_end)
        entries.append(_ENTRY.pack(kind, zlib.crc32(data), offset, len(data)))
    table = _TABLE_HEAD.pack(len(entries)) + b"".join(entries)
    header = _pack_header({"name": "crafted"}, len(out) - HEADER_SIZE, hashlib.sha256(table).digest())
    out[:len(header) + len(table)] = header + table
    target.write_bytes(bytes(out))
    return target


def _parts(source: Path) -> list[tuple[int, bytes]]:
    om = OmFile(source)
    return [(kind, bytes(om.partition(kind))) for kind in Partition if kind in om._partitions]


def _with_model(source: Path, edit) -> list[tuple[int, bytes]]:
    """The partitions of `source` with its MODEL_DEF edited in place (external references kept as they are)."""
    parts = []
    for kind, data in _parts(source):
        if kind == Partition.MODEL_DEF:
            model = onnx.ModelProto()
            model.ParseFromString(data)
            edit(model)
            data = model.SerializeToString()
        parts.append((kind, data))
    return parts


def _external_offset(value: str):
    def edit(model):
        tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
        next(e for e in tensor.external_data if e.key == "offset").value = value
    return edit


# case: (artifact, how it is crafted, a phrase the reason must hold)
ATTRIBUTE_CASES = {
    "kv_num_heads 2^31": ("contiguous", _set_attribute("FusedAttention", "kv_num_heads", 2**31),
                          "kv_num_heads 2147483648 is outside [1, 4096]"),
    "kv_num_heads not dividing": ("contiguous", _set_attribute("FusedAttention", "kv_num_heads", 5),
                                  "kv_num_heads 5 does not divide num_heads 4"),
    "kv_num_heads not the projection's": ("contiguous", _set_attribute("FusedAttention", "kv_num_heads", 1),
                                          "query has 128 columns"),
    "head_dim 0": ("contiguous", _set_attribute("FusedAttention", "head_dim", 0), "head_dim 0 is outside"),
    "sliding_window -1": ("contiguous", _set_attribute("FusedAttention", "sliding_window", -1),
                          "sliding_window -1 is outside"),
    "alibi slopes for 3 of 4 heads": ("contiguous", _set_attribute("FusedAttention", "alibi_slopes", [0.5, 0.25, 0.125]),
                                      "alibi_slopes has 3 values for num_heads 4"),
    "a NaN alibi slope": ("paged", _set_attribute("PagedAttention", "alibi_slopes", [0.5, float("nan"), 0.1, 0.1]),
                          "alibi_slopes holds a value that is not a finite number"),
    "a float head count": ("contiguous", _set_attribute("FusedAttention", "num_heads", 4.0),
                           "num_heads 4.0 is not an integer"),
    "an unknown attribute": ("contiguous", _set_attribute("RmsNorm", "gamma", 1), "unknown attribute gamma"),
    "a NaN epsilon": ("contiguous", _set_attribute("RmsNorm", "epsilon", float("nan")), "epsilon nan is not a finite"),
    "paged kv_num_heads not the pool's": ("paged", _set_attribute("PagedAttention", "kv_num_heads", 1),
                                          "query has 128 columns"),
    "paged kv_num_heads 5": ("paged", _set_attribute("PagedAttention", "kv_num_heads", 5),
                             "kv_num_heads 5 does not divide num_heads 4"),
    "negative page_size on a node": ("paged", _set_attribute("PagedAttention", "page_size", -16),
                                     "page_size -16 is outside [16, 512]"),
    "page_size not the pool's": ("paged", _set_attribute("PagedAttention", "page_size", 64),
                                 "page_size 64 is not the page pool's 128"),
    "layer past the pool": ("paged", _set_attribute("PagedAttention", "layer", 2), "layer 2 is outside"),
    "two nodes on one layer": ("paged", _set_attribute("PagedAttention", "layer", 0, index=1),
                               "layer 0 is outside the pool's 2 layers or taken"),
    "a node dropped": ("contiguous", lambda model, metadata, files: model.graph.node.remove(
        next(n for n in model.graph.node if n.op_type == "AddRmsNorm")), "is defined by no input, initializer or earlier"),
    "an output defined twice": ("contiguous", lambda model, metadata, files: model.graph.node[3].output.__setitem__(
        0, model.graph.node[1].output[0]), "is defined twice"),
    "no ai.onnx opset": ("contiguous", lambda model, metadata, files: model.opset_import.remove(
        next(o for o in model.opset_import if o.domain == "")), "domain ai.onnx is not imported"),
    "opset 99": ("contiguous", lambda model, metadata, files: setattr(
        next(o for o in model.opset_import if o.domain == ""), "version", 99), "ai.onnx version 99 is not one onnx"),
    "a block size the packed weight does not have": ("int4", _set_attribute("MatMulInt4", "block_size", 32),
                                                     "K 64, block_size 32 and bits 4 make [128, 2, 16]"),
    "an N the packed weight does not have": ("int4", _set_attribute("MatMulInt4", "N", 64),
                                             "the packed weight has shape [128, 1, 64]"),
    "3-bit weights": ("int4", _set_attribute("MatMulInt4", "bits", 3), "bits 3 is not one of 4, 8"),
    "a paged graph without its layout": ("paged", lambda model, metadata, files: metadata.pop("kv_cache"),
                                         "a PagedAttention, but metadata.kv_cache does not say"),
    "negative page_size in metadata": ("paged", _set_metadata(("kv_cache", "page_size"), -16),
                                       "metadata.kv_cache.page_size: -16 is outside [16, 512]"),
    "a layer count of the wrong type": ("paged", _set_metadata(("model", "num_layers"), "2"),
                                        "metadata.model.num_layers: '2' is not an integer"),
    "layer sizes for another layer count": ("paged", _set_metadata(("model", "layer_kv"), [[2, 16]]),
                                            "metadata.model.layer_kv: 1 layers, the graph has 2 attention nodes"),
    "layer sizes a node does not have": ("paged", _set_metadata(("model", "layer_kv"), [[2, 16], [1, 16]]),
                                         "kv_num_heads 2 is not metadata.model's num_kv_heads 1"),
    "layer sizes of three numbers": ("paged", _set_metadata(("model", "layer_kv"), [[2, 16, 1], [2, 16]]),
                                     "metadata.model.layer_kv[0]: 3 items, more than 2"),
    "a signature that is not a list": ("contiguous", _set_metadata(("signature", "inputs"), {"input_ids": 1}),
                                       "metadata.signature.inputs: {'input_ids': 1} is not a list"),
    "a model without its dimensions": ("contiguous", lambda model, metadata, files: metadata.pop("model"),
                                       "metadata.model: missing for a causal LM"),
    "a cache layout the signature does not have": ("contiguous", _set_metadata(("model", "kv_cache_io"), False),
                                                   "metadata.model.kv_cache_io: False, the graph makes it True"),
    "a model without its layer count": ("contiguous", lambda model, metadata, files: metadata["model"].pop("num_layers"),
                                        "metadata.model.num_layers: None, the graph makes it 2"),
    "an unknown layout": ("contiguous", _set_metadata(("kv_cache", "layout"), "ring"),
                          "metadata.kv_cache.layout: 'ring' is not one of"),
    "a dtype that is not one": ("contiguous", _set_metadata(("signature", "outputs", 0, "dtype"), "float99"),
                                "metadata.signature.outputs[0].dtype: 'float99' is not a dtype"),
    "a signature input the graph lacks": ("contiguous", _set_metadata(("signature", "inputs", 0, "name"), "tokens"),
                                          "the graph's input_ids is missing"),
    "a tokenizer.json that is not JSON": ("contiguous", _set_tokenizer("tokenizer.json", "{not json"),
                                          "tokenizer file tokenizer.json is invalid"),
    "a tokenizer_config.json that is a list": ("contiguous", _set_tokenizer("tokenizer_config.json", "[1]"),
                                               "tokenizer_config.json is not a JSON object"),
    "a chat template that does not compile": ("contiguous", _set_tokenizer("chat_template.jinja", "{% if %}"),
                                              "the chat template does not compile"),
}


@pytest.mark.parametrize("case", ATTRIBUTE_CASES, ids=list(ATTRIBUTE_CASES))
def test_a_crafted_artifact_is_refused_naming_the_field(case, contiguous_om, paged_om, int4_om, tmp_path):
    artifact, edit, phrase = ATTRIBUTE_CASES[case]
    source = {"contiguous": contiguous_om, "paged": paged_om, "int4": int4_om}[artifact]
    bad = _rewrite(source, tmp_path / "bad.om", edit)
    OmFile(bad)  # the container is sound: every CRC and the table's checksum match
    with pytest.raises(AtcError) as error:
        load_artifact(bad)
    assert error.value.code == "E13015"
    assert phrase in error.value.message


CONTAINER_CASES = {
    "a partition offset past the end": (lambda om: _pack_offsets(om, {Partition.METADATA: 1 << 40}),
                                        "runs past the end of the file"),
    "a partition offset inside another": (lambda om: _pack_offsets(om, {Partition.METADATA: _inside_the_graph(om)}),
                                          "overlap"),
    "an unaligned partition": (lambda om: _pack_offsets(om, {Partition.METADATA: 8}), "not 64-byte aligned"),
    "a partition twice": (lambda om: _parts(om) + [(Partition.METADATA, b"{}")], "appears twice"),
    "metadata that is not JSON": (lambda om: _replace(om, Partition.METADATA, b"\xff{"), "METADATA partition is not JSON"),
    "a lone surrogate for a dtype": (lambda om: _replace(om, Partition.METADATA, _escaped_metadata(
        om, _set_metadata(("signature", "inputs", 0, "dtype"), "\ud800"))), r"inputs[0].dtype: '\ud800' is not a dtype"),
    "a graph that is not ONNX": (lambda om: _replace(om, Partition.MODEL_DEF, b"\x0a\xff\xff\xff"),
                                 "MODEL_DEF partition is not an ONNX model"),
    "a tokenizer partition of numbers": (lambda om: _replace(om, Partition.TOKENIZER, b'{"tokenizer.json": 3}'),
                                         "not an object of file names to texts"),
    "an external-data offset outside the weights": (lambda om: _with_model(om, _external_offset(str(1 << 40))),
                                                    "is outside the weights partition"),
    "a negative external-data offset": (lambda om: _with_model(om, _external_offset("-64")),
                                        "is outside the weights partition"),
    "an external-data offset that is not a number": (lambda om: _with_model(om, _external_offset("0x40")),
                                                     "offset and length must be integers"),
}


def _pack_offsets(source: Path, offsets: dict[int, int]):
    return _parts(source), offsets


def _inside_the_graph(source: Path) -> int:
    """A table offset 64 bytes into the MODEL_DEF partition (the first one), aligned as partitions are."""
    table_end = HEADER_SIZE + _TABLE_HEAD.size + _ENTRY.size * len(_parts(source))
    return _align(table_end) - table_end + 64


def _escaped_metadata(source: Path, edit) -> bytes:
    """The metadata of `source` edited and encoded with JSON's escapes, which can spell what UTF-8 cannot
    (a lone surrogate)."""
    metadata = OmFile(source).metadata
    edit(None, metadata, None)
    return json.dumps(metadata).encode()


def _replace(source: Path, kind: int, data: bytes):
    return [(k, data if k == kind else d) for k, d in _parts(source)]


@pytest.mark.parametrize("case", CONTAINER_CASES, ids=list(CONTAINER_CASES))
def test_a_crafted_container_with_valid_checksums_is_refused(case, contiguous_om, tmp_path):
    craft, phrase = CONTAINER_CASES[case]
    crafted = craft(contiguous_om)
    parts, offsets = crafted if isinstance(crafted, tuple) else (crafted, None)
    bad = _pack(tmp_path / "bad.om", parts, offsets)
    with pytest.raises(AtcError) as error:
        load_artifact(bad)
    assert error.value.code == "E13015"
    assert phrase in error.value.message


def test_an_onnx_model_given_for_an_artifact_is_told_to_compile_first(tiny_llama_path):
    with pytest.raises(AtcError) as error:
        load_artifact(tiny_llama_path)
    assert error.value.code == "E13015" and "it is an ONNX model, not an offline model" in error.value.message


def test_the_packer_alone_makes_a_loadable_file(contiguous_om, paged_om, tmp_path):
    # the cases above differ from a good file only in what each changes
    for source in (contiguous_om, paged_om):
        assert load_artifact(_pack(tmp_path / "good.om", _parts(source))).model.graph.node


@pytest.mark.parametrize("case", ["kv_num_heads 2^31", "paged kv_num_heads 5", "a tokenizer.json that is not JSON"])
def test_cann_run_refuses_a_crafted_artifact_with_a_coded_error_and_no_traceback(case, contiguous_om, paged_om,
                                                                                  tmp_path):
    artifact, edit, phrase = ATTRIBUTE_CASES[case]
    bad = _rewrite(contiguous_om if artifact == "contiguous" else paged_om, tmp_path / "bad.om", edit)
    done = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "run", "--model", str(bad)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "NUMBA_BOUNDSCHECK": "1"})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "[ERROR] E13015" in done.stderr and phrase in done.stderr



def test_a_graph_onnxruntime_will_not_build_is_a_coded_error(contiguous_om, tmp_path):
    def string_constant(model, metadata, files):
        # a small constant (stored inline) of a type its consumer does not take: the loader's checks pass it
        tensor = next(t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
                      and t.data_type == onnx.TensorProto.INT64 and t.dims == [1])
        tensor.data_type = onnx.TensorProto.FLOAT
        tensor.ClearField("int64_data")
        tensor.raw_data = b"\0" * 4

    loaded = load_artifact(_rewrite(contiguous_om, tmp_path / "bad.om", string_constant))
    with pytest.raises(AtcError) as error:
        Executor(loaded)
    assert error.value.code == "E13015" and "onnxruntime refuses the graph" in error.value.message


@pytest.mark.parametrize("case", ["rotary table concatenated on axis 0", "embedding gathered on axis 1"])
def test_an_artifact_that_fails_its_first_step_is_refused_when_the_engine_loads(case, contiguous_om, paged_om,
                                                                                tmp_path):
    # every static check passes and onnxruntime builds the sessions; only a step shows that cos/sin no
    # longer fit the tokens (the paged kernel's check) or that the embedding's output is not [batch, seq,
    # hidden] (onnxruntime's)
    source, edit = {"rotary table concatenated on axis 0": (paged_om, _set_attribute("Concat", "axis", 0)),
                    "embedding gathered on axis 1": (contiguous_om, _set_attribute("Gather", "axis", 1))}[case]
    bad = _rewrite(source, tmp_path / "bad.om", edit)
    Executor(load_artifact(bad))
    with pytest.raises(AtcError) as error:
        LLMEngine(bad, kv_cache_pages=4, max_context_len=16, max_batch_size=1)
    assert error.value.code == "E13015" and "the graph fails a trial step" in error.value.message


def test_a_paged_graph_onnx_cannot_type_is_a_coded_error(paged_om, tmp_path):
    def default_domain_spelled_out(model, metadata, files):
        # "ai.onnx" names the default domain, but onnx's inference (which cuts the graph at its host nodes)
        # looks it up literally among the imports
        next(n for n in model.graph.node if n.op_type == "Mul").domain = "ai.onnx"

    loaded = load_artifact(_rewrite(paged_om, tmp_path / "bad.om", default_domain_spelled_out))
    with pytest.raises(AtcError) as error:
        Executor(loaded)
    assert error.value.code == "E13015" and "onnx's shape inference fails on the graph" in error.value.message


def test_nan_weights_make_nan_logits_not_an_exception_in_the_paged_kernel(paged_om, tmp_path):
    # weights are data, not checked: a file whose every weight is NaN (its checksums valid) must still run,
    # each step's scores and softmax sums NaN in the numba kernel, which divides by them
    om = OmFile(paged_om)
    model, metadata, files = om.graph(), om.metadata, om.tokenizer_files()
    weights = {name: np.full_like(view, np.nan) if view.dtype == np.float32 else view.copy()
               for name, view in om.weights(model).items()}
    bad = tmp_path / "nan.om"
    write_artifact(bad, model, metadata, files, detached=weights)
    with LLMEngine(bad, kv_cache_pages=4, max_context_len=16, max_batch_size=1) as engine:
        request = engine.submit([1, 2, 3], max_new_tokens=2, temperature=0.0, ignore_eos=True)
        request.result(timeout=120)
    assert len(request.output_ids) == 2


def test_an_artifact_records_what_it_needs(int4_om):
    from cann_llm.runtime.compatibility import OLDEST_READER

    needs = OmFile(int4_om).metadata["requires"]
    assert needs["runtime"] == OLDEST_READER and needs["soc_family"] == "Ascend910B"
    assert needs["isa"]["required"]["x86_64"] == []
    assert ["avx512_vnni", "avx_vnni"] in needs["isa"]["preferred"]["x86_64"]  # INT4 at accuracy level 4


def test_features_this_cpu_lacks_refuse_the_artifact_naming_them(int4_om, tmp_path):
    from cann_llm.runtime.compatibility import cpu_features, host_arch

    absent = next(f for f in ("amx_tile", "avx10_2", "sme2", "sve2") if f not in cpu_features())
    edited = _rewrite(int4_om, tmp_path / "needs.om",
                      _set_metadata(("requires", "isa", "required", host_arch()), [["avx2", "asimd"], [absent]]))
    with pytest.raises(AtcError) as caught:
        load_artifact(edited)
    assert caught.value.code == "E13016" and f"lacks: {absent}" in str(caught.value) and "avx2" not in str(caught.value)
    proc = subprocess.run([sys.executable, "-m", "cann_llm.cli.cann_run", "run", "--model", str(edited)], capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "E13016" in proc.stderr and absent in proc.stderr and "Traceback" not in proc.stderr


def test_a_newer_runtime_needed_refuses_and_a_missing_preference_warns(int4_om, tmp_path, caplog):
    from cann_llm.runtime.compatibility import cpu_features, host_arch

    # a hybrid's artifact records the onnxruntime its recurrent ops need (tests/test_hybrid_models.py)
    ops_newer = _rewrite(int4_om, tmp_path / "ops_newer.om", _set_metadata(("requires", "onnxruntime"), "99.0"))
    with pytest.raises(AtcError, match="E13016.*its ops need onnxruntime 99.0 or newer"):
        load_artifact(ops_newer)
    newer = _rewrite(int4_om, tmp_path / "newer.om", _set_metadata(("requires", "runtime"), "99.0.0"))
    with pytest.raises(AtcError, match="E13016.*needs runtime 99.0.0 or newer"):
        load_artifact(newer)
    absent = next(f for f in ("amx_tile", "avx10_2", "sme2", "sve2") if f not in cpu_features())
    slower = _rewrite(int4_om, tmp_path / "slower.om",
                      _set_metadata(("requires", "isa", "preferred", host_arch()), [[absent]]))
    with caplog.at_level("WARNING", logger="cann_llm"):
        load_artifact(slower)
    assert any(r.getMessage().startswith("W13001") and absent in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path, value", [(("requires", "isa"), "avx2"), (("requires", "isa", "required"), ["avx2"]),
                                         (("requires", "runtime"), 3), (("weights", "matmuls"), 5)])
def test_a_malformed_record_of_what_the_artifact_needs_or_holds_is_refused_naming_it(int4_om, tmp_path, path, value):
    edited = _rewrite(int4_om, tmp_path / "edited.om", _set_metadata(path, value))
    with pytest.raises(AtcError) as caught:
        load_artifact(edited)
    assert "metadata." + ".".join(path) in str(caught.value)
