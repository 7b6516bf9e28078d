"""ATC's dynamic-shape flags: `--dynamic_batch_size` and `--dynamic_dims` artifacts run every gear with the
outputs of static compiles of the same shapes, run a shape between gears at the next gear up with the same
outputs, refuse shapes outside with a code; `--input_shape` ranges are held at run time; and the flags'
own mistakes get ATC's codes."""

from __future__ import annotations

import numpy as np
import pytest

from cann_llm.cli.atc import run as atc
from cann_llm.compiler.compile import compile_model
from cann_llm.compiler.config import CompileConfig
from cann_llm.runtime.artifact import OmFile
from cann_llm.runtime.engine.engine import LLMEngine
from cann_llm.runtime.engine.setting_error import SettingError
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.loader import load_artifact

NAMES = ("input_ids", "attention_mask", "position_ids")
SEQ = 8


@pytest.fixture(scope="module")
def source():
    from cann_llm.models.tiny import tiny_onnx

    return str(tiny_onnx("llama", dynamo=True, with_past=False))


@pytest.fixture(scope="module")
def build(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gears")
    built = {}

    def compile_named(name: str, **flags) -> Executor:
        if name not in built:
            compile_model(CompileConfig(model=source, framework=5, output=str(folder / name),
                                        soc_version="Ascend910B", **flags))
            built[name] = Executor(load_artifact(folder / f"{name}.om"))
        return built[name]
    return compile_named


def _feeds(batch: int, seq: int = SEQ, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 256, (batch, seq)), "attention_mask": np.ones((batch, seq), np.int64),
            "position_ids": np.tile(np.arange(seq), (batch, 1))}


def _static(build, batch, seq):
    return build(f"static-{batch}x{seq}", input_shape={name: (batch, seq) for name in NAMES})


def test_batch_gears_equal_static_compiles_and_pad_between(build):
    geared = build("batch-gears", input_shape={name: (-1, SEQ) for name in NAMES}, dynamic_batch_size=(1, 2, 4))
    for batch in (1, 2, 3, 4):  # 3 runs at the gear of 4, cut back to 3 rows
        feeds = _feeds(batch)
        logits = geared.run(feeds)["logits"]
        assert logits.shape == (batch, SEQ, 256)
        np.testing.assert_allclose(logits, _static(build, batch, SEQ).run(feeds)["logits"], rtol=0, atol=1e-5)
    with pytest.raises(AtcError, match="E10001.*fits none of the gears.*input_ids:4,8"):
        geared.run(_feeds(5))
    with pytest.raises(AtcError, match="E10001.*dimension 1 must be 8"):
        geared.run(_feeds(2, SEQ + 1))
    contract = OmFile(geared.loaded.om.path).metadata["shape_contract"]
    assert contract["gear_kind"] == "batch" and [g["input_ids"] for g in contract["gears"]] == [[1, 8], [2, 8], [4, 8]]


def test_dims_gears_equal_static_compiles_and_pad_between(build):
    geared = build("dims-gears", input_shape={name: (1, -1) for name in NAMES}, input_format="ND",
                   dynamic_dims=((8, 8, 8), (16, 16, 16), (32, 32, 32)))
    free = build("free")
    for seq in (8, 16, 32):
        feeds = _feeds(1, seq)
        np.testing.assert_allclose(geared.run(feeds)["logits"], _static(build, 1, seq).run(feeds)["logits"],
                                   rtol=0, atol=1e-5)
    feeds = _feeds(1, 11)  # at the gear of 16: the padded positions come after the real ones
    np.testing.assert_allclose(geared.run(feeds)["logits"], free.run(feeds)["logits"], rtol=0, atol=1e-5)
    with pytest.raises(AtcError, match="E10001.*fits none of the gears"):
        geared.run(_feeds(1, 33))


@pytest.mark.parametrize("gear_flag, shape", [
    (["--dymBatch", "2"], (2, SEQ, 256)),
    (["--dymDims", "input_ids:1,16;attention_mask:1,16;position_ids:1,16"], (1, 16, 256)),
])
def test_cann_run_runs_the_gear_msame_names_and_refuses_one_not_compiled(build, tmp_path, gear_flag, shape):
    """msame's `--dymBatch N` and `--dymDims` pick the gear an ATC runner script asks for (made-up inputs of
    its shapes); a gear the artifact lacks is E10001 listing the gears it has."""
    import subprocess
    import sys

    geared = build("batch-gears", input_shape={name: (-1, SEQ) for name in NAMES}, dynamic_batch_size=(1, 2, 4)) \
        if gear_flag[0] == "--dymBatch" else build("dims-gears", input_shape={name: (1, -1) for name in NAMES},
                                                   input_format="ND", dynamic_dims=((8, 8, 8), (16, 16, 16), (32, 32, 32)))
    command = [sys.executable, "-m", "cann_llm.cli.cann_run", "run", "-m", str(geared.loaded.om.path), "--outfmt", "NPY"]
    done = subprocess.run([*command, *gear_flag, "-o", str(tmp_path), "--output_dirname", "out"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert np.load(tmp_path / "out" / "pure_infer_data_0.npy").shape == shape
    absent = [gear_flag[0], "3" if gear_flag[0] == "--dymBatch" else "input_ids:1,12"]
    other = ["--dymDims", "input_ids:1,8"] if gear_flag[0] == "--dymBatch" else ["--dymBatch", "1"]
    for args, words in ((absent, "names none of the gears"), (other, "not compiled with atc --dynamic_"),
                        ([*gear_flag, "--dymBatch" if gear_flag[0] == "--dymDims" else "--dymDims",
                          "1" if gear_flag[0] == "--dymDims" else "input_ids:1,8"], "give one")):
        refused = subprocess.run([*command, *args], capture_output=True, text=True)
        assert refused.returncode == 1 and "E10001" in refused.stderr and words in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


def test_input_shape_ranges_are_held_at_run_time(build):
    ranged = build("ranged", input_shape={name: ((1, 8), -1) for name in NAMES})
    assert ranged.run(_feeds(3, 5))["logits"].shape == (3, 5, 256)
    with pytest.raises(AtcError, match="E10001.*dimension 0 must be between 1 and 8"):
        ranged.run(_feeds(16, 5))


def test_the_engine_generates_through_gears_as_without_them(build):
    geared = build("dims-gears", input_shape={name: (1, -1) for name in NAMES}, input_format="ND",
                   dynamic_dims=((8, 8, 8), (16, 16, 16), (32, 32, 32)))
    free = build("free")
    prompts = [[5, 17, 99, 3, 42], [7, 1, 250, 33, 9, 120, 64, 2, 18]]
    outputs = []
    for executor in (geared, free):
        with LLMEngine(executor.loaded.om.path, max_context_len=32) as engine:
            results = engine.generate(prompts, max_new_tokens=12, temperature=0, ignore_eos=True)
            outputs.append([list(r.outputs[0].token_ids) for r in results])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("flags", [
    dict(input_shape={"input_ids": (-1, SEQ), "attention_mask": (-1, SEQ)}, dynamic_batch_size=(1, 2, 4)),
    dict(input_shape={"input_ids": (1, -1)}, input_format="ND", dynamic_dims=((8,), (16,))),
])
def test_gears_that_leave_out_an_input_sharing_their_dim_are_refused(source, tmp_path, flags):
    """The gear pads only the inputs it names: position_ids (or the mask) left at the fed size beside them
    would fail in onnxruntime at run time, so the compile names it."""
    with pytest.raises(AtcError) as caught:
        compile_model(CompileConfig(model=source, framework=5, output=str(tmp_path / "m"), soc_version="Ascend910B",
                                    **flags))
    assert caught.value.code == "E10001"
    assert "which position_ids shares" in caught.value.message or "which attention_mask shares" in caught.value.message
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag, gears", [
    ("--dynamic_dims", dict(input_format="ND", input_shape={name: (1, -1) for name in NAMES},
                            dynamic_dims=((4, 4, 4), (8, 8, 8)))),
    ("--dynamic_batch_size", dict(input_shape={name: (-1, SEQ) for name in NAMES}, dynamic_batch_size=(1, 2))),
])
def test_gears_on_a_cache_export_are_refused_at_compile(tmp_path, flag, gears):
    from cann_llm.models.tiny import tiny_onnx

    with pytest.raises(AtcError) as caught:
        compile_model(CompileConfig(model=str(tiny_onnx("llama", dynamo=True, with_past=True)), framework=5,
                                    output=str(tmp_path / "m"), soc_version="Ascend910B", **gears))
    assert caught.value.code == "E10055" and f"{flag} with a cache input (past_key_values.0.key)" in \
        caught.value.message


def test_the_engine_keeps_within_the_largest_gear(build):
    """Without a cache each step feeds the whole sequence, so the largest gear (16 tokens) bounds the context:
    a longer prompt is refused as too long for it, and a shorter one ends with "length" once 16 tokens were fed
    (its 17th sampled), with the tokens the artifact without gears gives."""
    geared = build("dims-gears-16", input_shape={name: (1, -1) for name in NAMES}, input_format="ND",
                   dynamic_dims=((8, 8, 8), (16, 16, 16)))
    prompt = [5, 17, 99, 3, 42, 7, 1, 250, 33, 9]
    with LLMEngine(geared.loaded.om.path) as engine:
        assert engine.max_context_len == 17
        with pytest.raises(SettingError, match="the prompt has 20 tokens; max_context_len is 17"):
            engine.generate([prompt * 2], max_new_tokens=4, temperature=0)
        result = engine.generate([prompt], max_new_tokens=12, temperature=0, ignore_eos=True)[0].outputs[0]
    with LLMEngine(build("free").loaded.om.path) as engine:
        free = engine.generate([prompt], max_new_tokens=7, temperature=0, ignore_eos=True)[0].outputs[0]
    assert (list(result.token_ids), result.finish_reason) == (list(free.token_ids), "length")


def test_a_paged_step_keeps_within_the_tokens_input_ids_was_compiled_for(tmp_path):
    """input_ids:1,1~16 on a paged artifact: a 40-token prompt goes in chunks of at most 16, and generates what
    the artifact without the range does."""
    from cann_llm.models.tiny import tiny_onnx

    cached = str(tiny_onnx("llama", dynamo=True, with_past=True))
    outputs = []
    for name, shape in (("ranged", {"input_ids": (1, (1, 16)), "position_ids": (1, (1, 16))}), ("free", None)):
        compile_model(CompileConfig(model=cached, framework=5, output=str(tmp_path / name), soc_version="Ascend910B",
                                    enable_paged_attention=True, **({"input_shape": shape} if shape else {})))
        with LLMEngine(tmp_path / f"{name}.om") as engine:
            result = engine.generate([list(range(3, 43))], max_new_tokens=8, temperature=0, ignore_eos=True)
            outputs.append(list(result[0].outputs[0].token_ids))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def _config(**flags):
    return CompileConfig(model="m.onnx", framework=5, output="o", soc_version="Ascend910B", **flags)


BATCH = {name: (-1, SEQ) for name in NAMES}
DIMS = {name: (1, -1) for name in NAMES}


@pytest.mark.parametrize("flags, code", [
    (dict(input_shape=BATCH, dynamic_batch_size=(1, 2), dynamic_dims=((1, 1, 1), (2, 2, 2))), "E10009"),
    (dict(input_shape_range={"input_ids": ((1, 8), SEQ)}, dynamic_batch_size=(1, 2)), "E10009"),
    (dict(input_shape=BATCH, dynamic_batch_size=(4,)), "E10035"),
    (dict(input_shape=BATCH, dynamic_batch_size=tuple(range(1, 102))), "E10036"),
    (dict(input_shape=DIMS, input_format="ND", dynamic_dims=((8, 8, 8), (16, 16))), "E10037"),
    (dict(input_shape=BATCH, dynamic_batch_size=(2, 2, 4)), "E10039"),
    (dict(input_shape={"input_ids": ((1, 8), -1)}, dynamic_batch_size=(1, 2)), "E10040"),
    (dict(input_shape={"input_ids": (1, SEQ)}, dynamic_batch_size=(1, 2)), "E10031"),
    (dict(input_shape={"input_ids": (-1, -1)}, dynamic_batch_size=(1, 2)), "E10018"),
    (dict(input_shape=DIMS, input_format="ND", dynamic_dims=((8,), (16,))), "E10045"),
    (dict(input_shape=DIMS, dynamic_dims=((8, 8, 8), (16, 16, 16))), "E10001"),  # needs --input_format=ND
    (dict(input_shape=BATCH, dynamic_batch_size=(1, 2), enable_paged_attention=True), "E10055"),
    (dict(input_shape=BATCH, input_shape_range=BATCH), "E10047"),
])
def test_dynamic_shape_mistakes_get_atcs_codes(flags, code):
    with pytest.raises(AtcError) as caught:
        _config(**flags)
    assert caught.value.code == code


def test_a_range_is_quoted_as_it_was_written():
    with pytest.raises(AtcError) as caught:
        _config(input_shape={"input_ids": ((1, 8), -1)}, dynamic_batch_size=(1, 2))
    assert "Value input_ids:1~8,-1 for parameter --input_shape" in caught.value.message


def test_the_flags_parse_as_atc_writes_them(tmp_path, source, capsys):
    cfg = CompileConfig.from_flags(model=source, framework="5", output="o", soc_version="Ascend910B",
                                   input_shape="input_ids:1,-1;attention_mask:1,-1;position_ids:1,-1",
                                   input_format="ND", dynamic_dims="8,8,8;16,16,16")
    assert [gear["input_ids"] for gear in cfg.gears] == [(1, 8), (1, 16)]
    for text in ("0,2", "1,x"):
        with pytest.raises(AtcError, match="E10038"):
            CompileConfig.from_flags(model=source, framework="5", output="o", soc_version="Ascend910B",
                                     input_shape="input_ids:-1,8", dynamic_batch_size=text)
    old = CompileConfig.from_flags(model=source, framework="5", output="o", soc_version="Ascend910B",
                                   input_shape_range="input_ids:[1~8,-1];attention_mask:[1~8,-1]")
    assert old.input_shapes == {"input_ids": ((1, 8), -1), "attention_mask": ((1, 8), -1)}
    assert any(w.startswith("W10004") for w in old.warnings)
    status = atc([f"--model={source}", "--framework=5", f"--output={tmp_path / 'b'}", "--soc_version=Ascend910B",
                  "--input_shape=input_ids:-1,8;attention_mask:-1,8;position_ids:-1,8",
                  "--dynamic_batch_size=1,2,4,8"])
    assert status == 0 and len(OmFile(tmp_path / "b.om").metadata["shape_contract"]["gears"]) == 4
