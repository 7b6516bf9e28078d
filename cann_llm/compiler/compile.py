"""`compile_model(cfg)`: ONNX in, `.om` out. The whole of `atc --mode=0` as a library call."""

from __future__ import annotations

import contextlib
import difflib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from cann_llm.compiler import __version__
from cann_llm.compiler.auto_tune import auto_tune
from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.graph_metadata import (attention_dimensions, float28_weights, int8_activations, kv_cache_metadata,
                                     onnxruntime_needed, shape_contract_metadata, weight_formats)
from cann_llm.compiler.graph_io import apply_input_shape, apply_out_nodes, apply_output_type, check_geared_inputs
from cann_llm.compiler.loader import import_graph, require_model_file, weight_bytes
from cann_llm.compiler.pass_manager import PassReport, run_passes
from cann_llm.compiler.pipeline import build_pipeline, known_passes
from cann_llm.compiler.precheck import check_ops, unsupported_types
from cann_llm.compiler.tokenizer_files import tokenizer_files
from cann_llm.compiler.traced_loops import describe, unrolled_loops
from cann_llm.models.recipes import detect_family
from cann_llm.passes.graph_utils import maskless_over_a_cache, position_table_rows, unfused_attention
from cann_llm.passes.name_causal_lm_io import token_input
from cann_llm.passes.per_sequence_rotary import rotary_switch_length
from cann_llm.passes.quant.quantize_weights import QuantizeWeights
from cann_llm.passes.pipeline_stages import layer_ranges, stage_graph
from cann_llm.passes.upcast_float_compute import compute_in_float32
from cann_llm.passes.upgrade_opset import upgrade_opset
from cann_llm.passes.weight_memory import detach_weights
from cann_llm.passes.weight_spill import weight_spill
from cann_llm.runtime.artifact import write_artifact
from cann_llm.runtime.compatibility import requirements
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import MATMUL_INT4, MATMUL_INT8
from cann_llm.runtime.progress import note
from cann_llm.runtime.safe_files import SCRATCH_PREFIX, Staged, reap_abandoned, refuse_symlink, staged
from cann_llm.runtime.signature import io_signature, is_dynamic, is_fixed, llm_dimensions

log = logging.getLogger("atc")


@dataclass
class CompileResult:
    """What a compile produced."""

    output: Path
    size: int
    report: PassReport
    metadata: dict
    warnings: list[str] = field(default_factory=list)


COLLECT_FROM_BYTES = 64 << 20
LOWERED_OPSET = 13  # the default-domain opset the cann ops' lowerings are written for
FUSION_RESULT = "fusion_result.json"


def _at_lowered_opset(graph: gs.Graph) -> gs.Graph:
    """`graph` at LOWERED_OPSET at least: the cann ops' onnxruntime lowerings write opset-13 forms (Unsqueeze and
    Split take axes and sizes as inputs), and an artifact of an older export (TorchScript at opset 11 or 12)
    was refused at load. Where onnx's converter cannot convert the graph, it stays as it is."""
    try:
        return upgrade_opset(graph, LOWERED_OPSET)
    except Exception as error:  # noqa: BLE001 - onnx's converter refuses some old ops; they stay as they are
        log.warning("opset %d kept: onnx's version converter could not raise it to %d (%s)", graph.opset,
                    LOWERED_OPSET, str(error).splitlines()[0] if str(error) else type(error).__name__)
        return graph


def _fixed_by_the_export(cfg: CompileConfig, graph: gs.Graph) -> list[int] | None:
    """input_ids' shape (found as CausalLmIoNamingPass finds it) if the export fixed every dim of it and
    `--input_shape` does not set them."""
    tokens = token_input(graph)
    if tokens is None or tokens.name in (cfg.input_shapes or {}) or tokens.shape is None:
        return None
    shape = list(tokens.shape)
    return shape if is_fixed(shape) else None


def compile_model(cfg: CompileConfig, *, progress: bool = False,
                  committed: Callable[[], None] | None = None) -> CompileResult:
    """Compile `cfg.model` into `cfg.output`.om; raises AtcError, leaving no output file, on failure.
    `progress` prints the load, each pass (calibration and quantization included) and the write on stderr.

    Everything is written under hidden names first and put in place at the end, together, with SIGINT and
    SIGTERM held meanwhile: whatever stops a compile, the output path holds what it held before (a previous
    artifact and its fusion_result.json included) or the whole new artifact. `committed` is called the
    moment it is in place, with those signals still held. Output folders that do not exist are made, as
    ATC makes them, and removed again if the compile fails."""
    output = cfg.output_path
    require_model_file(cfg.model)  # what is missing first, then where it would go
    with _output_folder(output), staged() as stage:
        result = _compile(cfg, output, stage, progress)
        stage.commit(committed)
    return result


def _compile(cfg: CompileConfig, output: Path, stage: Staged, progress: bool) -> CompileResult:
    start = time.perf_counter()
    model, graph = import_graph(cfg.model)
    # before the I/O flags: --output_type=FP16 asks for float16 outputs of the float32 graph
    raised = compute_in_float32(graph)
    fixed = _fixed_by_the_export(cfg, graph)
    if fixed and cfg.paging is not None:
        raise AtcError("E10055", f"--enable_paged_attention=1 is for generating, which feeds input_ids of another "
                                 f"length each step, and this export fixed input_ids at {fixed} (it was exported "
                                 f"without dynamic axes): export the model again with its batch and sequence axes "
                                 f"dynamic (docs/exporting.md#fixed-shapes)")
    unrolled = unrolled_loops(graph)
    if unrolled and cfg.paging is not None:
        raise AtcError("E10055", f"--enable_paged_attention=1 is for generating, and {describe(unrolled)}")
    origin = raised.weights if raised else None  # what must_keep_origin_dtype stores them back in
    if cfg.input_shapes:
        check_geared_inputs(graph, cfg.gears, "dims" if cfg.dynamic_dims else "batch")
        apply_input_shape(graph, cfg.input_shapes)
    if cfg.out_nodes:
        apply_out_nodes(graph, cfg.out_nodes)
    if cfg.output_type:
        apply_output_type(graph, cfg.output_type, paged=cfg.paging is not None)
    unsupported = unsupported_types(check_ops(graph))
    if unsupported:
        raise AtcError("E16002", ", ".join(unsupported))
    graph = _at_lowered_opset(graph)
    # weights a pass replaced hang in reference cycles with their old nodes; collecting after each pass frees
    # them (or the copies graphsurgeon loaded them into) before the next pass makes more; a pass that changed
    # nothing replaced none. A collection takes ~0.1 s, so small models, where the memory is no concern, skip it.
    weights = weight_bytes(model)
    note(f"load: {Path(cfg.model).name}, {len(graph.nodes)} nodes, {weights / 2**20:.1f} MiB of weights, "
         f"{time.perf_counter() - start:.2f} s", enabled=progress)
    collect = gc.collect if weights >= COLLECT_FROM_BYTES else None
    # the weights the passes pack stay on disk, not in memory, until they are written
    with weight_spill(output.parent) as spill:
        report = run_passes(graph, build_pipeline(cfg, progress=progress, spill=spill, origin=origin),
                            cfg.fusion_switches,
                            after_each=collect, progress=progress)
        causal_lm = "input_ids" in {t.name for t in graph.inputs} and "logits" in {t.name for t in graph.outputs}
        unfused = unfused_attention(graph)
        switched_off = any(r.name == "AttentionFusionPass" and not r.enabled for r in report.records)
        why = "AttentionFusionPass is switched off" if switched_off else \
            "--log=debug says why AttentionFusionPass refused each"
        warnings = [f"W10005: {unfused} attention block(s) did not fuse and run as the export wrote them (slower; "
                    f"no paged KV cache): {why}"] if unfused else []
        if fixed:
            warnings.append(f"W10007: the export fixed input_ids at {fixed} (it was exported without dynamic axes), "
                            f"so the artifact runs that one shape and cann-run and LLMEngine cannot generate with "
                            f"it; export the model again with its batch and sequence axes dynamic to generate")
        if unrolled:
            warnings.append(f"W10008: {describe(unrolled)}")
        if unknown := unknown_switches(cfg.fusion_switches):
            warnings.append(f"W10013: the fusion switches name {unknown}, which no pass they switch is: ignored "
                            f"(docs/atc.md lists the passes and which switch)")
        if maskless := maskless_over_a_cache(graph):
            warnings.append(f"W10012: {maskless} attention block(s) read a KV cache and hide no key: the export was "
                            f"traced with one new token over its cache, which needs no mask, so a prompt of several "
                            f"tokens attends every key as the export does (not causally); export it traced with "
                            f"several new tokens")
        tokenizer = tokenizer_files(cfg)  # read once: the warning below and each artifact written take it
        if causal_lm and not tokenizer:
            warnings.append("W10009: no tokenizer was packed (no tokenizer.json beside the model and no --tokenizer), "
                            "so the artifact takes token ids, not text (cann-run generate --prompt_ids); chat and "
                            "serve's text need one: compile with --tokenizer=DIR, the folder of the model's "
                            "tokenizer.json")
        if raised:
            low = raised.computed
            warnings.append(f"W10006: the model computes in {low}; it was compiled to compute in float32 (its "
                            f"inputs and outputs float32 too), so its outputs differ from a {low} run within "
                            f"{low}'s precision; {cfg.precision.storing(origin).stored}")
        quantized = next((r for r in report.records if r.name == QuantizeWeights.name and r.enabled), None)
        if cfg.quantization is not None and quantized is not None and quantized.effect_times == 0:
            came = sum(node.op in (MATMUL_INT4.name, MATMUL_INT8.name) for node in graph.nodes)
            why = (f"the model's {came} linear layers came quantized and are kept as they are, so the settings "
                   f"of weight compression do not apply to them" if came else "the model has no weight it takes")
            warnings.append(f"W10011: weight compression quantized no weight: {why} (atc --mode=6 shows how the "
                            f"artifact stores its weights)")
        if cfg.auto_tune_mode and not causal_lm:
            raise AtcError("E10055", "--auto_tune_mode measures a causal LM's decode and prefill; this model has no "
                                     "input_ids and logits")
        fusion_result = stage.path(output.parent / FUSION_RESULT) if cfg.export_compile_stat else None
        if fusion_result is not None:
            report.write_fusion_result(fusion_result)
        if cfg.pipeline_stages > 1:
            written = _write_stages(cfg, graph, model, report, progress, tokenizer, stage)
        else:
            written = [_write(cfg, output, stage.path(output), graph, model, report, progress, tokenizer)]
    (output, to), size, metadata = written[0][0], sum(size for _, size, _ in written), written[0][2]
    if cfg.auto_tune_mode:  # on the staged file: a search that fails or is stopped leaves the old artifact
        metadata["tuning"] = auto_tune(to, progress)
        size = to.stat().st_size
    return CompileResult(output=output, size=size, report=report, metadata=metadata, warnings=warnings)


def _write(cfg: CompileConfig, output: Path, to: Path, graph: gs.Graph, model: onnx.ModelProto, report: PassReport,
           progress: bool, tokenizer: dict[str, str], stage: dict | None = None,
           vocab: dict | None = None) -> tuple[tuple[Path, Path], int, dict]:
    """Write `graph` as the artifact `output`, at `to` (where it is staged): ((`output`, `to`), its size, its
    metadata). A pipeline `stage`'s metadata says which layers it holds, with the whole model's vocabulary
    (`vocab`) for its runtime."""
    start = time.perf_counter()
    detected = detect_family(graph)
    dimensions = attention_dimensions(graph)
    positions = position_table_rows(graph)
    switch = rotary_switch_length(graph)
    detached = detach_weights(graph)
    lowered = lower(graph, model)
    signature = io_signature(lowered)
    llm = {**(vocab or {}), **llm_dimensions(signature)}
    # with past/present I/O every layer is fed its cache, whether or not its attention fused, and the caches'
    # sizes are the past inputs' (a layer reusing another's cache has none)
    layers = {}
    if llm.get("kv_cache_io"):
        dimensions.pop("layer_kv", None)
        layers = {"num_layers": llm["num_layers"], **({"layer_kv": llm["layer_kv"]} if "layer_kv" in llm else {})}
    _check_cache_dims({**llm, **dimensions})
    metadata = {
        "name": output.stem,
        "atc_version": __version__,
        "soc_version": cfg.soc_version,
        "framework_type": cfg.framework,
        "cmdline": cfg.cmdline,
        "config": cfg.effective(),
        "signature": signature,
        "is_dynamic": is_dynamic(signature),
        "model": {**llm, **dimensions, **layers, "family": cfg.model_type or detected,
                  "detected_family": detected, **({"max_positions": positions} if positions else {}),
                  **({"rotary_switch_length": switch} if switch else {})},
        "kv_cache": kv_cache_metadata(cfg),
        **shape_contract_metadata(cfg),
        **({"pipeline": stage} if stage else {}),
        "weights": weight_formats(lowered, token.name if (token := token_input(graph)) is not None else None),
        "requires": requirements(cfg.soc.family, int8_activations(lowered), float28_weights(lowered),
                                 onnxruntime_needed(lowered)),
        "source": {"file": Path(cfg.model).name, "producer": f"{model.producer_name} {model.producer_version}".strip(),
                   "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import}},
        "pass_report": report.as_dict(),
    }
    size = write_artifact(to, lowered, metadata, tokenizer, detached)
    note(f"write: {output.name}, {size / 2**20:.1f} MiB, {time.perf_counter() - start:.2f} s", enabled=progress)
    return (output, to), size, metadata


def _check_cache_dims(dims: dict) -> None:
    """E10055 when the KV cache's heads or head size, or the vocabulary, are only named in the export
    (onnxruntime-genai's builder writes `kv_cache_dim`) and nothing fused gives them: the runtime could not
    size the cache it feeds or the logits it reads."""
    for key, fix in (("num_kv_heads", "--input_shape (every past_key_values.* input)"),
                     ("head_dim", "--input_shape (every past_key_values.* input)"), ("vocab_size", None)):
        if key in dims and not isinstance(dims[key], int):
            named = f"the named dim {dims[key]!r}" if dims[key] else "an unknown dim"
            where = "logits" if key == "vocab_size" else "past_key_values.*"
            raise AtcError("E10055", f"the model's {key.replace('_', ' ')} is {named} of {where}, and nothing "
                                     "compiled gives its size" + (f": give it with {fix}" if fix else ""))


def stage_paths(output: Path, stages: int) -> list[Path]:
    """The artifacts `--pipeline_stages` writes for `--output`: OUTPUT_stage0.om, OUTPUT_stage1.om, …"""
    return [output.with_name(f"{output.stem}_stage{i}.om") for i in range(stages)]


def _write_stages(cfg: CompileConfig, graph: gs.Graph, model: onnx.ModelProto, report: PassReport,
                  progress: bool, tokenizer: dict[str, str],
                  stage: Staged) -> list[tuple[tuple[Path, Path], int, dict]]:
    """One artifact per layer range (cann_llm/passes/pipeline_stages.py), each told the whole model's vocabulary,
    each staged in `stage`."""
    logits = next(t for t in graph.outputs if t.name == "logits")
    vocab = {"vocab_size": int(logits.shape[-1])}
    ranges = layer_ranges(graph, cfg.pipeline_stages)
    num_layers = ranges[-1][1]
    paths = stage_paths(cfg.output_path, len(ranges))
    staged_at = [stage.path(path) for path in paths]
    written = []
    for index in range(len(ranges)):
        first, end = ranges[index]
        layers = {"stage": index, "stages": len(ranges), "layers": [first, end], "num_layers": num_layers,
                  "files": [path.name for path in paths]}
        written.append(_write(cfg, paths[index], staged_at[index], stage_graph(graph, first, end), model, report,
                              progress, tokenizer, layers, vocab))
    return written


def unknown_switches(switches: dict[str, bool]) -> str:
    """The switched pass names that switch nothing (no pass has the name, each given with the pass it most
    likely meant, or the pass always runs), ALL aside; "" when none."""
    known = known_passes()
    said = []
    for name in sorted(set(switches) - {"ALL"}):
        if name in known and not known[name]:
            said.append(f"{name} (which always runs)")
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)  # a misspelling, not a kin
            said.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return ", ".join(said)


def lower(graph: gs.Graph, source: onnx.ModelProto) -> onnx.ModelProto:
    """The optimised graph as an ONNX model, stamped as ours; weights still inline."""
    model = gs.export_onnx(graph, do_type_check=False)
    _drop_outer_copies(model.graph)
    _unique_node_names(model.graph)
    model.ir_version = source.ir_version
    model.producer_name, model.producer_version = "atc", __version__
    del model.metadata_props[:]
    return model


def _unique_node_names(graph: onnx.GraphProto) -> None:
    """Number the second and later nodes of one name apart, in place (subgraphs each on their own): onnxruntime
    refuses a graph with two nodes of one name, and a fusion names its node after the block it replaces, which
    an unrolled loop repeats (TorchScript's trace of eager MoE experts)."""
    seen: dict[str, int] = {}
    taken = {node.name for node in graph.node}
    for node in graph.node:
        if node.name:
            count = seen.get(node.name, 0)
            seen[node.name] = count + 1
            if count:
                while f"{node.name}_{count + 1}" in taken:
                    count += 1
                node.name = f"{node.name}_{count + 1}"
                taken.add(node.name)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                _unique_node_names(sub)


def _drop_outer_copies(graph: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> None:
    """Remove from each subgraph the initializers graphsurgeon copied in from an outer scope, in place.

    graphsurgeon exports every outer constant a subgraph reads as that subgraph's own initializer; ONNX
    subgraphs see the outer scope's, so the copies only multiply the artifact (a 3.5 MB model of `If`s
    nested six deep on run-time conditions lowered to 195 MB). Names are unique across scopes (SSA), so
    an equal name is the same tensor."""
    if outer and any(t.name in outer for t in graph.initializer):
        kept = [t for t in graph.initializer if t.name not in outer]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    visible = outer | {t.name for t in graph.initializer}
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                _drop_outer_copies(sub, visible)


@contextlib.contextmanager
def _output_folder(output: Path) -> Iterator[None]:
    """`output`'s folder, made with its missing parents before any work (ATC makes them too); those made are
    removed again, if still empty, when the compile fails. Refused (E13004) where nothing could be written.
    Scratch files a killed compile of the same output left there are removed first."""
    folder = output.parent
    for path in (output, folder / FUSION_RESULT):
        if refuse_symlink(path).is_dir():
            raise AtcError("E13004", path, "the path is a directory")
    missing = [path for path in (folder, *folder.parents) if not path.exists() and not path.is_symlink()]
    present = missing[-1].parent if missing else folder
    if not present.is_dir():
        raise AtcError("E13004", output, f"{present} is not a directory")
    if not os.access(present, os.W_OK | os.X_OK):
        raise AtcError("E13004", output, f"the directory {present} is not writable")
    made = []  # by this compile: another one making the same folder at once keeps its own
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:
                continue
            made.append(path)
    except OSError as error:
        _remove_empty(made)
        raise AtcError("E13004", output, error.strerror or str(error)) from None
    reap_abandoned(folder, SCRATCH_PREFIX)
    try:
        yield
    except BaseException:
        _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):  # the innermost first
        try:
            folder.rmdir()
        except OSError:  # no longer empty: something else writes there now
            return
