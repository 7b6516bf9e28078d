"""The host-kernel registry: ops the runtime executes itself, keyed by (domain, op_type).

A kernel is a plain function named after its op: ONNX inputs positional (None for a missing optional
input), attributes keyword-only with the op's defaults; it returns an array or a tuple of arrays.
Everything not registered here runs on onnxruntime, which `supports()` checks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

CUSTOM_DOMAIN = "cann"
STANDARD_DOMAINS = ("", "ai.onnx")

Kernel = Callable[..., object]
KERNELS: dict[tuple[str, str], Kernel] = {}

# onnxruntime turns these into initializers while loading, so they have no kernel of their own
_GRAPH_LEVEL_OPS = frozenset({("", "Constant")})


def register_kernel(op_type: str, domain: str = CUSTOM_DOMAIN) -> Callable[[Kernel], Kernel]:
    """Decorator adding a kernel to the registry."""

    def add(fn: Kernel) -> Kernel:
        KERNELS[(domain, op_type)] = fn
        return fn

    return add


@lru_cache(maxsize=1)
def _onnxruntime_cpu_ops() -> frozenset[tuple[str, str]]:
    from onnxruntime.capi import _pybind_state

    return frozenset(("" if k.domain == "ai.onnx" else k.domain, k.op_name)
                     for k in _pybind_state.get_all_opkernel_def() if k.provider == "CPUExecutionProvider")


def reference_ops() -> list[type]:
    """The registry's kernels as onnx.reference custom ops (OpRun classes), one per registered op."""
    from onnx.reference.op_run import OpRun

    classes = []
    for (domain, op_type), kernel in KERNELS.items():
        def _run(self, *inputs, _kernel=kernel, **attributes):
            outputs = _kernel(*inputs, **attributes)
            return outputs if isinstance(outputs, tuple) else (outputs,)

        classes.append(type(op_type, (OpRun,), {"op_domain": domain, "_run": _run}))
    return classes


def supports(domain: str | None, op_type: str) -> bool:
    """Whether some backend can execute `domain::op_type`."""
    domain = "" if domain in (None, "ai.onnx") else domain
    key = (domain, op_type)
    return key in KERNELS or key in _GRAPH_LEVEL_OPS or key in _onnxruntime_cpu_ops()


# kernels register themselves on import
from runtime.kernels import attention, moe, norms, quant_matmul  # noqa: E402,F401
