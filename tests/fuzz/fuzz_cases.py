"""One fuzz case, run the way a user would: compile an ONNX file with `compile_model`, or load a `.om` and
run one engine step on it. The only acceptable outcomes are success and `AtcError` (other than E19999,
ATC's "unknown error"); anything else is reported with its type and the project line that raised it.

Run as a script it is a worker: JSON cases on stdin, one JSON outcome per line on the stdout it was
started with (fuzz_pool.py), so a segfault or a hang costs the worker, not the harness.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# a mutated size can ask for terabytes: a bounded address space turns that into MemoryError, not a dead machine
ADDRESS_SPACE_LIMIT = 8 << 30
STEP_TIMEOUT = 60.0


def _where(error: BaseException) -> str:
    """The innermost frame of the project's own code (not tests/, not site-packages) in the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(str(REPO)) and "/.venv/" not in f.filename
            and "/tests/" not in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    return f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno} in {frame.name}"


def _root(error: BaseException) -> BaseException:
    """The exception a step failure wraps (the engine reports a failed step as GenerationFailed from it)."""
    while type(error).__name__ == "GenerationFailed" and error.__cause__ is not None:
        error = error.__cause__
    return error


def classify(error: BaseException) -> dict:
    """The outcome record of a case that raised `error`."""
    from cann_llm.runtime.errors import AtcError

    root = _root(error)
    if isinstance(root, AtcError) and root.code != "E19999":
        return {"outcome": "refused", "code": root.code}
    kind = type(root).__name__
    # a failed step names the exception it ended with in its message: "request 3 failed: ValueError: ..."
    inner = re.match(r"request \d+ failed: (\w+): (E\d{5})?", str(root)) if kind == "GenerationFailed" else None
    if inner and inner.group(1) == "AtcError" and inner.group(2) not in (None, "E19999"):
        return {"outcome": "refused", "code": inner.group(2)}
    if inner:
        kind = f"{kind}({inner.group(1)})"
    return {"outcome": "error", "type": kind, "where": _where(root), "message": str(root)[:300]}


def run_om(path: str) -> dict:
    """Load the artifact and generate two tokens greedily (a text prompt when it carries a tokenizer)."""
    from cann_llm.runtime.engine.engine import LLMEngine

    with LLMEngine(path, kv_cache_pages=8, max_context_len=64, max_batch_size=2, threads=1) as engine:
        prompt = "fuzz ok" if engine.tokenizer is not None else [1, 2, 3]
        engine.submit(prompt, max_new_tokens=2, temperature=0.0).result(timeout=STEP_TIMEOUT)
    return {"outcome": "ok"}


def run_onnx(path: str, flags: dict) -> dict:
    """Compile `path` with `flags`; for a model that compiles, then run it as `run_om` does."""
    from cann_llm.compiler.compile import compile_model
    from cann_llm.compiler.config import CompileConfig

    output = Path(path).with_name("out")
    cfg = CompileConfig(model=path, framework=5, output=str(output), soc_version="Ascend910B", **flags)
    result = compile_model(cfg)
    outcome = run_om(str(result.output))
    return {**outcome, "compiled": True}


def run_case(case: dict) -> dict:
    """Run one case (`{"kind": "om"|"onnx", "path": ..., "flags": {...}}`) and classify how it ended."""
    start = time.perf_counter()
    try:
        outcome = run_om(case["path"]) if case["kind"] == "om" else run_onnx(case["path"], case.get("flags", {}))
    except Exception as error:  # noqa: BLE001 - the point is to classify whatever escapes
        outcome = classify(error)
    outcome["seconds"] = round(time.perf_counter() - start, 3)
    return outcome


def _serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # library prints must not interleave with the replies
    import cann_llm.compiler.compile  # noqa: F401 - imported before "ready", so a case's time is its own
    import cann_llm.runtime.engine.engine  # noqa: F401

    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        replies.write(json.dumps(run_case(json.loads(line))) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _serve()
