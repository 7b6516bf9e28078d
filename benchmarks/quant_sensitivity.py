"""Where INT4 loses perplexity: each group of layers quantized alone, the rest kept float.

    python benchmarks/quant_sensitivity.py --onnx .cache/smollm2-dynamo/model.onnx --conf quant.json

Compiles the float graph as atc would (every pass before weight quantization), calibrates once, quantizes
every MatMul with the configuration's method, and then scores the held-out text with float weights
swapped for what the quantized ones compute (onnxruntime, float activations): all of them, each kind of
projection alone, and each transformer block alone. The perplexity increase of a group alone says how
much of the total it causes (the increases roughly add up when they are small).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from cann_llm.cli.quant import fused_graph
from cann_llm.compiler.config import CompileConfig
from cann_llm.compiler.pipeline import calibration_samples, tokenizer_files
from cann_llm.models.data_files import EVAL_TEXT
from cann_llm.passes.graph_utils import lm_head
from cann_llm.passes.quant.calibration import collect_input_statistics
from cann_llm.passes.quant.config import QuantConfig
from cann_llm.passes.quant.search import quantize_weights_together
from cann_llm.passes.weight_memory import detach_weights
from cann_llm.runtime.kernels.matmul_nbits_layout import QuantizedWeight, dequantize_blockwise
from cann_llm.runtime.lowering import lower_for_onnxruntime
from cann_llm.runtime.ort_session import session_options
from cann_llm.runtime.perplexity import perplexity
from cann_llm.runtime.proto_utils import initializers_as_inputs
from cann_llm.runtime.signature import io_signature, llm_dimensions
from cann_llm.runtime.tokenizer import TextTokenizer


class FedWeightsSession:
    """The slice of `Executor` that `perplexity` uses, over a float graph whose weights are fed."""

    def __init__(self, model, signature: dict, dims: dict, weights: dict[str, np.ndarray]):
        lowered = initializers_as_inputs(lower_for_onnxruntime(model), lambda t: t.name in weights)
        self.session = ort.InferenceSession(lowered.SerializeToString(), session_options(),
                                            providers=["CPUExecutionProvider"])
        self.loaded = type("Loaded", (), {"metadata": {"signature": signature, "model": dims}})()
        self.weights = weights

    def run(self, feeds: dict, outputs: list[str]) -> dict[str, np.ndarray]:
        return dict(zip(outputs, self.session.run(outputs, {**feeds, **self.weights})))


def projection_kind(node: gs.Node, previous: str | None) -> str:
    """The projection a fused MatMul is: qkv and gate_up by their fusion's name, then o after qkv and down
    after gate_up (a block's MatMuls come in that order)."""
    if "FusedAttention_qkv" in node.name:
        return "qkv"
    if "GateUp" in node.name:
        return "gate_up"
    return "o" if previous == "qkv" else "down"


@dataclass
class QuantizedMatMul:
    """One MatMul of the float graph, quantized as the configuration says."""

    node: gs.Node
    kind: str  # qkv, o, gate_up or down
    weight: QuantizedWeight
    input_scale: np.ndarray | None  # AWQ's per-input-channel scale, None without one

    @property
    def name(self) -> str:
        return self.node.inputs[1].name

    def effective(self) -> np.ndarray:
        """The float weight the quantized one computes."""
        values = dequantize_blockwise(self.weight)
        return values if self.input_scale is None else values * self.input_scale[:, None]


def quantize_float_graph(onnx_path: Path, conf: str) -> tuple[CompileConfig, gs.Graph, list, list[QuantizedMatMul]]:
    """The graph as atc fuses it before quantizing, its calibration samples, and every MatMul with a
    constant weight but the lm_head quantized with the configuration's method (calibrated once)."""
    quant = QuantConfig.from_json(conf)
    cfg = CompileConfig(model=str(onnx_path), framework=5, output="/tmp/unused", soc_version="Ascend910B",
                        quantization=quant)
    graph = fused_graph(cfg)
    head = lm_head(graph)
    matmuls = [n for n in graph.nodes if n.op == "MatMul" and n is not head and isinstance(n.inputs[1], gs.Constant)]
    samples = calibration_samples(cfg)
    statistics = collect_input_statistics(graph, sorted({n.inputs[0].name for n in matmuls}), samples,
                                          with_hessian=quant.needs_calibration)
    quantized, kind = [], None
    for node in matmuls:
        stats = statistics.get(node.inputs[0].name)
        (q,), scale = quantize_weights_together([np.asarray(node.inputs[1].values)], quant.method, quant.bits,
                                                quant.group_size, quant.symmetric, stats and stats.hessian,
                                                stats and stats.mean_abs, quant.act_order, quant.damp)
        kind = projection_kind(node, kind)
        quantized.append(QuantizedMatMul(node, kind, q, scale))
    return cfg, graph, samples, quantized


def eval_ids(cfg: CompileConfig, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of the held-out text, in the model's tokenizer."""
    return TextTokenizer(tokenizer_files(cfg)).encode(EVAL_TEXT.read_text(encoding="utf-8"))[:max_tokens]


def scoring_session(graph: gs.Graph, extra_outputs: list[str] = ()) -> tuple[FedWeightsSession, dict[str, np.ndarray]]:
    """A session over a copy of the float graph whose weights are fed (swap them in `session.weights`),
    and the float weights; `extra_outputs` names inner values it returns too."""
    copy = graph.copy()
    weights = detach_weights(copy)
    model = gs.export_onnx(copy, do_type_check=False)
    signature = io_signature(model)
    for name in extra_outputs:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return FedWeightsSession(model, signature, llm_dimensions(signature), dict(weights)), weights


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--onnx", "onnx_path", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--conf", required=True, type=click.Path(exists=True), help="a --compress_weight_conf JSON")
@click.option("--max_tokens", default=4096, show_default=True, help="score the first N tokens of the text")
@click.option("--out", default=None, type=click.Path(path_type=Path), help="write the results as JSON")
def main(onnx_path: Path, conf: str, max_tokens: int, out: Path | None) -> None:
    """Print perplexity with each group of layers quantized alone."""
    cfg, graph, _, matmuls = quantize_float_graph(onnx_path, conf)
    groups: dict[str, list[str]] = {}
    block = -1
    quantized: dict[str, np.ndarray] = {}
    for matmul in matmuls:
        quantized[matmul.name] = matmul.effective()
        block += matmul.kind == "qkv"
        groups.setdefault(f"all {matmul.kind}", []).append(matmul.name)
        groups.setdefault(f"block {block:02d}", []).append(matmul.name)
    session, weights = scoring_session(graph)
    ids = eval_ids(cfg, max_tokens)
    base = perplexity(session, ids).perplexity
    results = {"float": base}
    click.echo(f"{'float':<14} {base:8.3f}")
    for name, members in [("all", list(quantized)), *sorted(groups.items())]:
        session.weights = {**weights, **{m: quantized[m] for m in members}}
        value = perplexity(session, ids).perplexity
        results[name] = value
        click.echo(f"{name:<14} {value:8.3f}  {100 * (value / base - 1):+6.2f}%")
    if out:
        out.write_text(json.dumps({"conf": json.loads(Path(conf).read_text()), "max_tokens": max_tokens,
                                   "perplexity": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
