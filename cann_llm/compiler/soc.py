"""Target profiles named by `--soc_version`.

Execution is always on the host CPU; a profile only sets defaults (KV page size, quantization group)
and is recorded in the artifact, as ATC records the soc it compiled for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SocProfile:
    """Defaults a target implies."""

    family: str
    page_size: int
    quant_group_size: int


_FAMILIES = {
    "Ascend910B": SocProfile("Ascend910B", page_size=128, quant_group_size=128),
    "Ascend910_93": SocProfile("Ascend910_93", page_size=128, quant_group_size=128),
    "Ascend910": SocProfile("Ascend910", page_size=128, quant_group_size=128),
    "Ascend310P": SocProfile("Ascend310P", page_size=128, quant_group_size=64),
    "Ascend310B": SocProfile("Ascend310B", page_size=64, quant_group_size=64),
}

# Full soc names as `npu-smi info` reports them, plus the family short names users type; a family name wins
# over the full name it equals ("Ascend910B" is the 910B family, not the first Ascend 910's B variant).
SOC_VERSIONS: dict[str, SocProfile] = {f"Ascend910B{i}": _FAMILIES["Ascend910B"] for i in range(1, 5)}
SOC_VERSIONS.update({f"Ascend910{s}": _FAMILIES["Ascend910"] for s in ("A", "B", "ProA", "ProB", "PremiumA")})
SOC_VERSIONS.update({f"Ascend310P{i}": _FAMILIES["Ascend310P"] for i in (1, 3)})
SOC_VERSIONS.update({f"Ascend310B{i}": _FAMILIES["Ascend310B"] for i in (1, 4)})
SOC_VERSIONS.update({f"Ascend910_93{i:02d}": _FAMILIES["Ascend910_93"] for i in (62, 72, 91, 92)})
SOC_VERSIONS.update({name: profile for name, profile in _FAMILIES.items() if name != "Ascend910_93"})
