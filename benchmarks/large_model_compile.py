"""Compiling a model larger than the memory the compile may use: a synthetic Llama-architecture model of ~6 GB of
float32 weights (cann_llm/models/synthetic_llama.py) compiled FP32, INT4 RTN and INT4 AWQ inside a memory cgroup
limited to 2 GiB (the kernel enforces it: past the limit it reclaims page cache, and kills the compile if
that is not enough), then checked against onnxruntime on the original.

    sudo python benchmarks/large_model_compile.py [--gigabytes 6] [--limit_mb 2048] [--modes fp32,int4,awq]

Needs a writable cgroup memory controller (root: v1 at /sys/fs/cgroup/memory or v2 at /sys/fs/cgroup). For
each mode: the wall time, the peak of the compile's anonymous memory (RssAnon, sampled every 50 ms: what
the compile itself holds, as opposed to pages of the mapped weights, which the kernel reclaims), the
cgroup's peak charge (page cache included) and whether the kernel killed it; then, for each artifact, the
greedy continuation of a fixed prompt against onnxruntime's on the original (eight tokens) and the largest
difference of the first step's logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = [11, 73, 5, 201, 42, 9, 150, 33]
STEPS = 8
MODES = {
    "fp32": [],
    "int4": ["--enable_compress_weight=1", "--compress_weight_conf={folder}/rtn.json"],
    "awq": ["--compress_weight_conf={folder}/awq.json", "--tokenizer={folder}/tokenizer"],
}


class MemoryGroup:
    """A cgroup (v1 or v2) limited to `limit` bytes that a command is started in."""

    def __init__(self, limit: int):
        v1 = Path("/sys/fs/cgroup/memory")
        self.v1 = v1.is_dir() and (v1 / "memory.limit_in_bytes").exists()
        base = v1 if self.v1 else Path("/sys/fs/cgroup")
        self.path = base / f"large_model_compile_{os.getpid()}"
        self.path.mkdir()
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))
        if not self.v1:
            (self.path / "memory.swap.max").write_text("0")

    def run(self, argv: list[str]) -> tuple[int, float, float]:
        """(exit status, seconds, peak RssAnon in MiB) of `argv` run inside the group."""
        start = time.perf_counter()
        process = subprocess.Popen(["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *argv],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak = 0.0
        while process.poll() is None:
            peak = max(peak, _anon_mib(process.pid))
            time.sleep(0.05)
        process.stderr.read()
        return process.returncode, time.perf_counter() - start, peak

    def peak_mib(self) -> float:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        path = self.path / name
        return int(path.read_text()) / 2**20 if path.exists() else float("nan")

    def close(self) -> None:
        self.path.rmdir()


def _anon_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _reference(model: Path) -> tuple[list[int], np.ndarray]:
    """onnxruntime's greedy continuation of PROMPT on the original, and its first logits row."""
    import onnxruntime as ort

    from cann_llm.runtime.feeds import causal_lm_inputs
    from cann_llm.runtime.signature import io_signature, llm_dimensions

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    import onnx

    signature = io_signature(onnx.load(str(model), load_external_data=False))
    dims = llm_dimensions(signature)
    ids, first, tokens = list(PROMPT), None, []
    for _ in range(STEPS):
        feeds = causal_lm_inputs(signature, dims, np.asarray([ids], np.int64), 0)
        logits = session.run(["logits"], feeds)[0][0, -1]
        first = logits if first is None else first
        tokens.append(int(np.argmax(logits)))
        ids.append(tokens[-1])
    return tokens, first


def _ours(om: Path) -> tuple[list[int], dict[int, float]]:
    """The artifact's greedy continuation of PROMPT and the first step's 20 most likely log-probabilities."""
    from cann_llm.runtime.engine.engine import LLMEngine
    from cann_llm.runtime.engine.sampling import MAX_LOGPROBS, SamplingParams

    with LLMEngine(om, max_context_len=64, kv_cache_pages=8, max_batch_size=1) as engine:
        output = engine.generate([PROMPT], SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True,
                                                          logprobs=MAX_LOGPROBS))[0].outputs[0]
    return list(output.token_ids), dict(output.logprobs[0].top)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gigabytes", default=6.0, show_default=True, help="float32 weights of the synthetic model")
@click.option("--limit_mb", default=2048, show_default=True, help="the compile's memory limit")
@click.option("--modes", default="fp32,int4,awq", show_default=True)
@click.option("--folder", type=click.Path(file_okay=False, path_type=Path), default=ROOT / ".cache" / "synthetic-6g",
              show_default=True)
@click.option("--compare_also", default="", help="modes compiled before (their .om in --folder) to compare too")
def main(gigabytes: float, limit_mb: int, modes: str, folder: Path, compare_also: str) -> None:
    """Build the model if missing, compile it in each mode under the limit, compare with onnxruntime."""
    from cann_llm.models.synthetic_llama import build
    from cann_llm.models.tiny import byte_tokenizer_json

    model = folder / "model.onnx"
    if not model.exists():
        click.echo(f"building the synthetic model in {folder} ...")
        build(gigabytes, folder)
    (folder / "tokenizer").mkdir(exist_ok=True)
    (folder / "tokenizer" / "tokenizer.json").write_text(byte_tokenizer_json())
    (folder / "rtn.json").write_text(json.dumps({"quant_mode": "INT4", "group_size": 128}))
    (folder / "awq.json").write_text(json.dumps({"quant_mode": "INT4", "group_size": 128, "algorithms": [{"name": "awq"}],
                                                 "calibration": {"num_samples": 4, "seq_len": 64}}))
    weights = sum(p.stat().st_size for p in folder.glob("model.onnx*")) / 2**20
    click.echo(f"model: {weights:.0f} MiB on disk; limit {limit_mb} MiB ({weights / limit_mb:.1f}x smaller)")
    results = {}
    for mode in modes.split(","):
        group = MemoryGroup(limit_mb * 2**20)
        try:
            argv = [str(Path(sys.executable).parent / "atc"), f"--model={model}", "--framework=5",
                    f"--output={folder / mode}", "--soc_version=Ascend910B", "--enable_paged_attention=1",
                    *(flag.format(folder=folder) for flag in MODES[mode])]
            status, seconds, anon = group.run(argv)
            results[mode] = (status, seconds, anon, group.peak_mib())
        finally:
            group.close()
        verdict = "ok" if status == 0 else ("killed by the kernel" if status in (-9, 137) else f"exit {status}")
        click.echo(f"{mode}: {verdict} in {seconds:.0f} s; peak RssAnon {anon:.0f} MiB, cgroup peak "
                   f"{results[mode][3]:.0f} MiB (limit {limit_mb})")
    reference_tokens, reference_first = _reference(model)
    compared = [mode for mode, (status, *_rest) in results.items() if status == 0]
    compared += [mode for mode in filter(None, compare_also.split(",")) if (folder / f"{mode}.om").exists()]
    for mode in compared:
        tokens, top = _ours(folder / f"{mode}.om")
        reference = reference_first - np.logaddexp.reduce(reference_first)
        difference = max(abs(logprob - reference[token]) for token, logprob in top.items())
        click.echo(f"{mode}: greedy tokens {'equal' if tokens == reference_tokens else 'differ'} "
                   f"({tokens} against {reference_tokens}); the first step's top-20 log-probabilities differ by "
                   f"at most {difference:.2e}")


if __name__ == "__main__":
    main()
