"""`--auto_tune_mode`: the engine settings of a compiled artifact measured on this machine, the best written into it.

ATC's own auto-tune searched NPU kernel tilings; here the choices that move a CPU's speed are the engine's:
the thread count, which kernel runs the 4- and 8-bit matmuls (the native int8 one or onnxruntime's
MatMulNBits), and the prefill chunk (`max_num_batched_tokens`). The search is coordinate-wise, each
candidate measured in a process of its own (cann_llm/runtime/engine/tuning.py: batch-1 greedy decode and a
1,024-token prefill, medians of three), kept when one rate beats the current choice's by more than `MARGIN`
and the other loses no more than that (so noise keeps the defaults). The defaults and the choice are then
measured again, alternating: the choice is recorded as the artifact's settings only when it was at least
as fast in both (else the defaults stay), with the trials and the effect, in the `tuning` section;
`LLMEngine` uses the settings by default.

The page size and the flash-prefill block sizes are fixed at compile time and in the kernels, and are not
searched.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from cann_llm.runtime.artifact import OmFile, write_artifact
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.progress import note

MARGIN = 0.03
BOTH = ("decode_tok_s", "prefill_tok_s")
CHUNKS = (256, 512, 1024, 2048)


def auto_tune(path: Path, progress: bool = False) -> dict:
    """Search the engine settings for the artifact at `path`, record them in it, and return its `tuning`."""
    om = OmFile(path)
    metadata = om.metadata
    quantized = any(node.op_type == "MatMulInt4" for node in om.graph().graph.node)
    paged = (metadata.get("kv_cache") or {}).get("layout") == "paged"
    trials: list[dict] = []

    def trial(settings: dict) -> dict:
        result = {"settings": settings, **_measure(path, settings)}
        trials.append(result)
        note(f"auto tune: {json.dumps(settings) or 'defaults'}: decode {result['decode_tok_s']:.1f} tok/s, "
             f"prefill {result['prefill_tok_s']:.0f} tok/s", enabled=progress)
        return result

    best = {}
    current = trial({})
    cores = os.cpu_count() or 1
    # the default pool has a thread per logical core: fewer is what there is to try (half, for SMT siblings)
    candidates = [({"threads": threads}, BOTH) for threads in sorted({1, cores // 2} - {0, cores})]
    candidates += [({"native_matmul": False}, BOTH)] if quantized else []
    # 512 is EngineConfig's default chunk: the current choice's measurement stands for it. A chunk changes
    # prefill only (a decode step is one token a sequence), so it is judged by prefill alone
    candidates += [({"max_num_batched_tokens": chunk}, ("prefill_tok_s",)) for chunk in CHUNKS if chunk != 512] \
        if paged else []
    for candidate, rates in candidates:
        result = trial({**best, **candidate})
        if _better(result, current, rates):
            best, current = result["settings"], result
    effect = compare_with_defaults(path, best, rounds=2)
    # the confirmation decides: a choice not at least as fast as the defaults in both is not kept
    kept = best if min(effect.values()) >= 1.0 else {}
    tuning = {"settings": kept, "searched": best, "trials": trials, "effect": effect,
              "host": {"machine": platform.machine(), "cpu": _cpu_name(), "cores": cores}}
    _record(om, tuning)
    return tuning


def _better(result: dict, current: dict, rates: tuple[str, ...]) -> bool:
    """Of `rates`, one up by more than MARGIN and none down by more than it."""
    up = [result[rate] / current[rate] for rate in rates]
    return max(up) > 1 + MARGIN and min(up) >= 1 - MARGIN


def _measure(path: Path, settings: dict) -> dict:
    # absolute: the trial runs from the package's folder, not the caller's
    process = subprocess.run([sys.executable, "-m", "cann_llm.runtime.engine.tuning", str(Path(path).resolve()),
                              json.dumps(settings)], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    if process.returncode != 0:
        lines = process.stderr.strip().splitlines()
        raise AtcError("E19999", reason=f"auto tune trial {json.dumps(settings)} failed: "
                                        f"{lines[-1] if lines else process.returncode}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def compare_with_defaults(path: Path, settings: dict, rounds: int, report=None) -> dict:
    """`settings` against the defaults, measured alternately: each rate's median ratio; `report(round,
    defaults, tuned)` sees each round's measurements."""
    if not settings:
        return {"decode": 1.0, "prefill": 1.0}
    ratios: dict[str, list[float]] = {"decode": [], "prefill": []}
    for number in range(1, rounds + 1):
        default, tuned = _measure(path, {}), _measure(path, settings)
        if report is not None:
            report(number, default, tuned)
        ratios["decode"].append(tuned["decode_tok_s"] / default["decode_tok_s"])
        ratios["prefill"].append(tuned["prefill_tok_s"] / default["prefill_tok_s"])
    return {name: round(statistics.median(values), 3) for name, values in ratios.items()}


def _record(om: OmFile, tuning: dict) -> None:
    """Write the artifact again with `tuning` in its metadata (the graph and weights as they are)."""
    model, metadata, files = om.graph(), om.metadata, om.tokenizer_files()
    metadata["tuning"] = tuning
    weights = om.weights(model)
    write_artifact(om.path, model, metadata, files, detached=weights)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
