"""Learned rounding for the MLPs (AutoRound's idea, numpy): does optimising INT4 rounding against each MLP's
output close group 32's perplexity gap? (The answer: docs/performance.md#quantization-choices.)

    python benchmarks/mlp_rounding.py --onnx .cache/smollm2-dynamo/model.onnx --conf quant.json

Quantizes every MatMul as the configuration says (e.g. AWQ then GPTQ, group 32, zero points), then for each
transformer block learns an offset in [-0.5, 0.5] per weight of gate/up and down that moves its rounding,
by signed gradient descent (AutoRound's SignSGD) on the MLP's output error over calibration activations:
the gradient goes through the down projection, SiLU(gate)·up and the gate/up projection, with the
straight-through estimate for the rounding. Scales and zero points stay as the method chose them. An
MLP keeps what it learned only if its output error fell. Perplexity is then scored on the held-out text
with float activations (as benchmarks/quant_sensitivity.py does): float, all quantized as configured, and
with the MLPs' learned rounding.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np
from quant_sensitivity import eval_ids, quantize_float_graph, scoring_session

from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.perplexity import perplexity


class _Rounding:
    """A quantized weight as w/s + v rounded, for a learnable offset v (starting where the method rounded)."""

    def __init__(self, weight: np.ndarray, quantized, input_scale: np.ndarray | None):
        rows = weight.shape[0]
        expand = lambda a: np.repeat(a.astype(np.float32), quantized.block_size, axis=0)[:rows]  # noqa: E731
        self.step = expand(quantized.scales)
        self.zero = expand(quantized.zero_points) if quantized.zero_points is not None else np.zeros_like(self.step)
        self.input_scale = np.ones((rows, 1), np.float32) if input_scale is None else input_scale[:, None]
        self.scaled = weight / self.input_scale
        self.top = 2 ** quantized.bits - 1
        self.start = (quantized.values.astype(np.float32) - self.zero) - self.scaled / self.step
        self.offset = self.start.copy()

    def weight(self) -> tuple[np.ndarray, np.ndarray]:
        """The weight the offsets give, and where its integers are inside the range (the gradient's mask)."""
        q = np.rint(self.scaled / self.step + self.offset) + self.zero
        return (np.clip(q, 0, self.top) - self.zero) * self.step * self.input_scale, (q >= 0) & (q <= self.top)

    def move(self, gradient: np.ndarray, rate: float) -> None:
        self.offset -= rate * np.sign(gradient)
        np.clip(self.offset, self.start - 0.5, self.start + 0.5, out=self.offset)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def learn_mlp(x: np.ndarray, gate_up: _Rounding, down: _Rounding, steps: int, batch: int, seed: int) -> tuple[float, float]:
    """SignSGD on the MLP's output error; returns the error before and after (mean squared, all of x)."""
    inter = down.scaled.shape[0]
    float_gate_up, float_down = gate_up.scaled * gate_up.input_scale, down.scaled * down.input_scale
    hidden = x @ float_gate_up
    target = (_silu(hidden[:, :inter]) * hidden[:, inter:]) @ float_down

    def error() -> float:
        h = x @ gate_up.weight()[0]
        return float(np.mean(((_silu(h[:, :inter]) * h[:, inter:]) @ down.weight()[0] - target) ** 2))

    before = error()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = rng.choice(len(x), min(batch, len(x)), replace=False)
        xb, tb = x[rows], target[rows]
        (w_gu, inside_gu), (w_d, inside_d) = gate_up.weight(), down.weight()
        h = xb @ w_gu
        g, u = h[:, :inter], h[:, inter:]
        sig = 1 / (1 + np.exp(-g))
        a = g * sig * u
        dy = 2 * (a @ w_d - tb) / tb.size
        da = dy @ w_d.T
        dh = np.concatenate([da * u * sig * (1 + g * (1 - sig)), da * g * sig], axis=1)
        # d(weight)/d(offset) is step * input scale, positive: the sign of the weight's gradient is the offset's
        down.move((a.T @ dy) * inside_d, 1.0 / steps)
        gate_up.move((xb.T @ dh) * inside_gu, 1.0 / steps)
    return before, error()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--onnx", "onnx_path", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--conf", required=True, type=click.Path(exists=True), help="a --compress_weight_conf JSON")
@click.option("--steps", default=200, show_default=True, help="SignSGD steps per MLP")
@click.option("--batch", default=512, show_default=True, help="token rows per step")
@click.option("--samples", default=8, show_default=True, help="calibration samples whose MLP inputs are learned on")
@click.option("--max_tokens", default=4096, show_default=True, help="score the first N tokens of the text")
def main(onnx_path: Path, conf: str, steps: int, batch: int, samples: int, max_tokens: int) -> None:
    """Print perplexity: float, quantized as configured, and with the MLPs' rounding learned."""
    cfg, graph, calibration, matmuls = quantize_float_graph(onnx_path, conf)
    quantized = {matmul.name: matmul.effective() for matmul in matmuls}
    roundings, mlps = {}, []
    for matmul in matmuls:
        if matmul.kind in ("gate_up", "down"):
            roundings[matmul.name] = _Rounding(np.asarray(matmul.node.inputs[1].values), matmul.weight,
                                               matmul.input_scale)
            if matmul.kind == "gate_up":
                mlps.append([matmul.node])
            else:
                mlps[-1].append(matmul.node)
    # one session both returns the MLPs' inputs and scores the text (it runs only the outputs asked for)
    session, weights = scoring_session(graph, [gate_up.inputs[0].name for gate_up, _ in mlps])
    signature, dims = session.loaded.metadata["signature"], session.loaded.metadata["model"]
    inputs = {gate_up.inputs[0].name: [] for gate_up, _ in mlps}
    for ids in calibration[:samples]:
        out = session.run(causal_lm_inputs(signature, dims, np.asarray(ids)[None]), list(inputs))
        for name, value in out.items():
            inputs[name].append(value.reshape(-1, value.shape[-1]))
    learned = {}
    for index, (gate_up, down) in enumerate(mlps):
        x = np.concatenate(inputs.pop(gate_up.inputs[0].name))
        pair = roundings[gate_up.inputs[1].name], roundings[down.inputs[1].name]
        before, after = learn_mlp(x, *pair, steps, batch, seed=index)
        if after < before:
            learned[gate_up.inputs[1].name], learned[down.inputs[1].name] = pair[0].weight()[0], pair[1].weight()[0]
        click.echo(f"block {index:02d}: MLP output error {before:.3e} -> {after:.3e}"
                   f"{'' if after < before else ' (kept the method rounding)'}")
    ids = eval_ids(cfg, max_tokens)
    for label, chosen in [("float", {}), ("quantized", quantized), ("MLP rounding learned", {**quantized, **learned})]:
        session.weights = {**weights, **chosen}
        click.echo(f"{label:<22} {perplexity(session, ids).perplexity:8.3f}")


if __name__ == "__main__":
    main()
