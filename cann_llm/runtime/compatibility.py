"""Whether an artifact can run here, checked when it is loaded: the runtime version it needs and the CPU
features its kernels use.

The compiler records `requires` in the metadata (`requirements`): the oldest runtime that reads what it
wrote, the oldest onnxruntime whose contrib ops it runs where that is newer than the package's floor (a
hybrid's recurrent ops), the `--soc_version` profile (informational: every profile runs on the host CPU, its settings are
already in the graph and the KV cache section), and per CPU architecture the features its graph needs
(`required`) and those its kernels are fast with (`preferred`), each a list of groups of which one feature
must be present. CPU features are named as Linux names them in /proc/cpuinfo (`avx2`, `avx512_vnni`,
`asimddp`).

A missing requirement is E13016 naming it; a missing preference is warning W13001 (the model runs, slower
than it was compiled to).
"""

from __future__ import annotations

import logging
import platform
from functools import lru_cache

from cann_llm.runtime.errors import AtcError

RUNTIME_VERSION = "0.1.0"
# the oldest runtime that reads the artifacts this version writes (the runtime checks it, a newer one too)
OLDEST_READER = "0.1.0"

log = logging.getLogger("cann_llm")

_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
# int8 dot products: the INT4 kernels at accuracy level 4 and the W8A8 matmuls run on them
_INT8_DOT = {"x86_64": ["avx512_vnni", "avx_vnni"], "aarch64": ["asimddp"]}
_FLOAT = {"x86_64": [["avx2"], ["fma"]], "aarch64": [["asimd"]]}
# float32 weights in 28 bits (MatMulF28): its kernel decodes them with AVX-512 VBMI's byte permute
_FLOAT28 = {"x86_64": [["avx512vbmi"]], "aarch64": []}


def requirements(soc_family: str, int8_activations: bool, float28: bool = False, onnxruntime: str | None = None) -> dict:
    """The `requires` section for an artifact of `soc_family` whose matmuls do (or not) take int8 activations
    and read float32 weights in 28 bits, and which needs `onnxruntime` or newer (its contrib ops) if given."""
    preferred = {arch: [*groups, *([_INT8_DOT[arch]] if int8_activations else []), *(_FLOAT28[arch] if float28 else [])]
                 for arch, groups in _FLOAT.items()}
    return {"runtime": OLDEST_READER, "soc_family": soc_family, **({"onnxruntime": onnxruntime} if onnxruntime else {}),
            "isa": {"required": {arch: [] for arch in _FLOAT}, "preferred": preferred}}


def check(metadata: dict, path: str) -> None:
    """Refuse (E13016) an artifact that cannot run here; warn (W13001) where it runs slower than compiled for."""
    needs = metadata.get("requires")
    if not needs:
        return
    if _version(needs.get("runtime", "0")) > _version(RUNTIME_VERSION):
        raise AtcError("E13016", path, f"it needs runtime {needs['runtime']} or newer; this is {RUNTIME_VERSION}")
    if "onnxruntime" in needs:
        import onnxruntime

        if _version(needs["onnxruntime"]) > _version(onnxruntime.__version__):
            raise AtcError("E13016", path, f"its ops need onnxruntime {needs['onnxruntime']} or newer; this is "
                                           f"{onnxruntime.__version__} (pip install -U onnxruntime)")
    arch, have = host_arch(), cpu_features()
    isa = needs.get("isa", {})
    missing = _missing(isa.get("required", {}).get(arch, []), have)
    if missing:
        raise AtcError("E13016", path, f"its kernels need CPU features this {arch} CPU lacks: {', '.join(missing)}")
    slower = _missing(isa.get("preferred", {}).get(arch, []), have)
    if slower:
        log.warning("W13001: %s runs slower than compiled for: this CPU lacks %s", path, ", ".join(slower))


def _missing(groups: list[list[str]], have: frozenset[str]) -> list[str]:
    """Each group none of whose features is present, written `a or b`."""
    return [" or ".join(group) for group in groups if not any(feature in have for feature in group)]


def host_arch() -> str:
    """This machine's architecture as the artifact names them (x86_64, aarch64)."""
    return _ARCHES.get(platform.machine().lower(), platform.machine().lower())


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's features as /proc/cpuinfo names them; elsewhere, numpy's detection in lower case."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return frozenset(name.lower() for name, present in __cpu_features__.items() if present)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())
