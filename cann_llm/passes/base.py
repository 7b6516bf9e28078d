"""The pass interface: a pass is an object with a `name` (ATC style, `<Thing>FusionPass`), a `switchable` flag
(whether `--fusion_switch_file` may turn it off) and `run(graph) -> PassResult`. Passes never print; they
return counts and, when they matched nothing, the reasons their candidates failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import onnx_graphsurgeon as gs


@dataclass
class PassResult:
    """What one pass did: candidates matched, rewrites applied, and why candidates were refused."""

    match_times: int = 0
    effect_times: int = 0
    rejections: list[str] = field(default_factory=list)


class Pass(Protocol):
    name: str
    switchable: bool

    def run(self, graph: gs.Graph) -> PassResult: ...
