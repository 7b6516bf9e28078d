"""The pass runner and the pass report (ATC's fusion_result.json); the pass interface is cann_llm/passes/base.py."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs

from cann_llm.compiler.fusion_switch import is_enabled
from cann_llm.passes.base import Pass
from cann_llm.runtime.progress import note
from cann_llm.runtime.safe_files import write_text

log = logging.getLogger("atc")


@dataclass
class PassRecord:
    """One line of the pass report."""

    name: str
    enabled: bool
    match_times: int = 0
    effect_times: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "enabled": self.enabled, "match_times": self.match_times,
                "effect_times": self.effect_times}


@dataclass
class PassReport:
    """The ordered records of a pipeline run, and the node counts around it."""

    records: list[PassRecord] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    def as_dict(self) -> dict:
        """Deterministic form for the artifact (no timings: two compiles must give identical bytes)."""
        return {"nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
                "passes": [record.as_dict() for record in self.records]}

    def fusion_result(self) -> dict:
        """ATC's fusion_result.json shape: counts as strings, one entry per pass that ran (summed over runs)."""
        totals: dict[str, list[int]] = {}
        for record in self.records:
            if record.enabled:
                counts = totals.setdefault(record.name, [0, 0])
                counts[0] += record.match_times
                counts[1] += record.effect_times
        graph_fusion = {name: {"match_times": str(m), "effect_times": str(e)} for name, (m, e) in totals.items()}
        return {"session_and_graph_id_0_0": {"graph_fusion": graph_fusion, "ub_fusion": {}}}

    def write_fusion_result(self, path: Path) -> None:
        write_text(path, json.dumps(self.fusion_result(), indent=4) + "\n")


def run_passes(graph: gs.Graph, passes: list[Pass], switches: dict[str, bool],
               after_each: Callable[[], object] | None = None, progress: bool = False) -> PassReport:
    """Run `passes` in order on `graph` (mutated in place), honouring the fusion switches; `after_each` is
    called after every pass that changed the graph; `progress` prints a line per pass on stderr as it ends
    (`pass_line`)."""
    report = PassReport(nodes_before=len(graph.nodes))
    width = max((len(p.name) for p in passes), default=0)
    for index, p in enumerate(passes, 1):
        enabled = not p.switchable or is_enabled(switches, p.name)
        record = PassRecord(p.name, enabled)
        report.records.append(record)
        if not enabled:
            log.info("%s: switched off", p.name)
            note(pass_line(index, len(passes), width, record), enabled=progress)
            continue
        start = time.perf_counter()
        result = p.run(graph)
        record.seconds = time.perf_counter() - start
        record.match_times, record.effect_times = result.match_times, result.effect_times
        log.info("%s: matched %d, applied %d, %.2f s, %d nodes", p.name, result.match_times,
                 result.effect_times, record.seconds, len(graph.nodes))
        note(pass_line(index, len(passes), width, record), enabled=progress)
        for reason in result.rejections:
            log.debug("%s: candidate refused: %s", p.name, reason)
        if after_each is not None and result.effect_times:
            after_each()
    report.nodes_after = len(graph.nodes)
    return report


def pass_line(index: int, total: int, width: int, record: PassRecord) -> str:
    """`[ 3/27] FusedAttentionFusionPass  matched 2, applied 2  0.41 s`, or `... switched off`."""
    counter = f"[{index:>{len(str(total))}}/{total}]"
    if not record.enabled:
        return f"{counter} {record.name:<{width}}  switched off"
    return (f"{counter} {record.name:<{width}}  matched {record.match_times}, applied {record.effect_times}  "
            f"{record.seconds:.2f} s")
