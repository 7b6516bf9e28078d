"""The host-kernel registry: ops the runtime executes itself, keyed by (domain, op_type).

A kernel is a plain function named after its op (cann_llm/runtime/ops.py holds the op's contract): ONNX inputs
positional (None for a missing optional input), attributes keyword-only; the registry fills in the op's
attribute defaults, so a kernel declares none of its own. It returns an array or a tuple of arrays.
A host kernel (`host=True`) reads and writes the runtime's state between onnxruntime sessions (the paged
KV cache): the executor cuts the graph at its nodes and calls it with `run=`, the step's `HostRun`.
Everything not registered here runs on onnxruntime, which `supports()` checks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

# first: numba reads its cache directory when it is first imported
from cann_llm.runtime.kernels import numba_cache  # noqa: F401
from cann_llm.runtime.ops import CUSTOM_DOMAIN, Op

Kernel = Callable[..., object]


@dataclass(frozen=True)
class Registered:
    """A kernel and what the executor needs to know about it."""

    kernel: Kernel
    host: bool = False


KERNELS: dict[tuple[str, str], Registered] = {}

# onnxruntime turns these into initializers while loading, so they have no kernel of their own
_GRAPH_LEVEL_OPS = frozenset({("", "Constant")})


@dataclass
class HostRun:
    """What one run hands its host kernels: the KV page pool (`key[layer]`, `value[layer]`), whether to run
    the fast kernels or the numpy references, and a memo for what a step's nodes share (its metadata,
    prepared once)."""

    kv_cache: Any
    fast: bool = True
    shared: dict = field(default_factory=dict)


def register_kernel(op: Op, domain: str = CUSTOM_DOMAIN, host: bool = False) -> Callable[[Kernel], Kernel]:
    """Decorator adding the kernel of `op` to the registry; the decorated function fills in `op`'s defaults."""

    def add(fn: Kernel) -> Kernel:
        @functools.wraps(fn)
        def with_defaults(*inputs, **attrs):
            return fn(*inputs, **{**op.defaults, **attrs})

        KERNELS[(domain, op.name)] = Registered(with_defaults, host)
        return with_defaults

    return add


def host_kernel(node) -> Kernel | None:
    """The host kernel of an ONNX node, or None when the node runs inside a backend session."""
    found = KERNELS.get((node.domain or "", node.op_type))
    return found.kernel if found is not None and found.host else None


def is_host_node(node) -> bool:
    """Whether the executor runs `node` itself, between sessions (cann_llm/runtime/segments.py cuts there)."""
    return host_kernel(node) is not None


@lru_cache(maxsize=1)
def _onnxruntime_cpu_ops() -> frozenset[tuple[str, str]]:
    from onnxruntime.capi import _pybind_state

    return frozenset(("" if k.domain == "ai.onnx" else k.domain, k.op_name)
                     for k in _pybind_state.get_all_opkernel_def() if k.provider == "CPUExecutionProvider")


def reference_ops() -> list[type]:
    """The registry's session kernels as onnx.reference custom ops (OpRun classes), one per registered op, and
    the standard ops whose onnx.reference form cannot run what exporters write (cann_llm/runtime/kernels/reference_fixes.py)."""
    from onnx.reference.op_run import OpRun

    from cann_llm.runtime.kernels.reference_fixes import REPLACED

    classes = []
    for (domain, op_type), registered in KERNELS.items():
        if registered.host:
            continue

        def _run(self, *inputs, _kernel=registered.kernel, **attributes):
            outputs = _kernel(*inputs, **attributes)
            return outputs if isinstance(outputs, tuple) else (outputs,)

        classes.append(type(op_type, (OpRun,), {"op_domain": domain, "_run": _run}))
    return classes + list(REPLACED)


def supports(domain: str | None, op_type: str) -> bool:
    """Whether some backend can execute `domain::op_type`."""
    domain = "" if domain in (None, "ai.onnx") else domain
    key = (domain, op_type)
    return key in KERNELS or key in _GRAPH_LEVEL_OPS or key in _onnxruntime_cpu_ops()


# kernels register themselves on import
from cann_llm.runtime.kernels import (  # noqa: E402,F401
    attention, float28, float32_panels, moe, norms, paged_attention, quant_matmul, recurrent)
