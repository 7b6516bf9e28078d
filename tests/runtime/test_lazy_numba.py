"""numba is imported only by a process that runs a numba kernel (or bm25s, for a long document): importing the
runtime or the `cann-run` commands, or generating on a paged artifact whose attention runs in the native op,
leaves it out; the host-attention fallback brings it in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.kernels import native

_GENERATE = """
import json, sys
from runtime.engine.engine import LLMEngine

with LLMEngine(sys.argv[1], max_batch_size=1, max_context_len=32, kv_cache_pages=4,
               host_attention=sys.argv[2] == "host") as engine:
    request = engine.submit([3, 1, 4, 1, 5], max_new_tokens=4, temperature=0, ignore_eos=True)
    request.result()
print(json.dumps({"numba": "numba" in sys.modules, "ids": request.output_ids}))
"""


def _in_a_fresh_process(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["runtime.engine.engine", "cann_llm", "cli.cann_run", "cli.serve"])
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
