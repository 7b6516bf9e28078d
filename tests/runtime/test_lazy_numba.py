"""numba is imported only by a process that runs a numba kernel (or bm25s, for a long document): importing the
runtime or the `cann-run` commands, or generating on a paged artifact whose attention runs in the native op,
leaves it out; the host-attention fallback brings it in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cann_llm.runtime.kernels import native

_GENERATE = """
import json, sys
from cann_llm.runtime.engine.engine import LLMEngine

with LLMEngine(sys.argv[1], max_batch_size=1, max_context_len=32, kv_cache_pages=4,
               host_attention=sys.argv[2] == "host") as engine:
    request = engine.submit([3, 1, 4, 1, 5], max_new_tokens=4, temperature=0, ignore_eos=True)
    request.result()
print(json.dumps({"numba": "numba" in sys.modules, "ids": request.output_ids}))
"""


def _in_a_fresh_process(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["cann_llm.runtime.engine.engine", "cann_llm", "cann_llm.cli.cann_run", "cann_llm.cli.serve"])
def test_importing_the_runtime_imports_no_numba(module):
    assert _in_a_fresh_process("-c", f"import sys, {module}; print('numba' in sys.modules)") == "False"


def test_only_the_host_attention_fallback_imports_numba(compiled, tmp_path):
    from tests.passes.test_paged_kv_cache import _compile_paged

    try:
        native.library_path()
    except native.NativeUnavailable as why:
        pytest.skip(f"no native op here: {why}")
    _, loaded = _compile_paged(("llama", False, True, "sdpa"), compiled, tmp_path)
    om = str(loaded.om.path)
    in_native, on_host = (json.loads(_in_a_fresh_process("-c", _GENERATE, om, where)) for where in ("native", "host"))
    assert not in_native["numba"] and on_host["numba"]
    assert len(in_native["ids"]) == 4 and in_native["ids"] == on_host["ids"]


def test_kernels_compile_while_torch_export_has_replaced_max_and_min(tmp_path):
    """torch.export swaps builtins.max and min for wrappers while it traces, process-wide: the executor's
    warm-up thread compiling meanwhile must still get working kernels (numba keeps a failed compile)."""
    # the first kernel compiled before (numba's own typing set up, as in any process that ran one), the
    # attention kernels, which take the larger and smaller of two numbers, while the wrappers are in place
    script = ("from torch._export.non_strict_utils import _override_builtin_ops\n"
              "from cann_llm.runtime.kernels import warmup\n"
              "first, *kernels = warmup._signatures()[:3]\n"
              "first[0].compile(first[1])\n"
              "with _override_builtin_ops():\n"
              "    for kernel, types in kernels:\n"
              "        kernel.compile(types)\n"
              "print(len(kernels))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # compiled here, not read from numba's cache
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-2000:]
