"""Operator support check (ATC's --mode=3 and the first step of every compile).

Every unsupported operator is reported at once, never the first one alone: converting a model should
not be a loop of fix-one-rerun.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx_graphsurgeon as gs

from cann_llm.runtime.kernels import supports
from cann_llm.runtime.safe_files import write_text

OK, TYPE_UNSUPPORTED = 0, 1


def check_ops(graph: gs.Graph) -> list[dict]:
    """One record per node in ATC's check_result.json form."""
    records = []
    for node in graph.nodes:
        domain = node.domain or "ai.onnx"
        if supports(node.domain, node.op):
            records.append({"name": node.name, "type": node.op, "result": "success",
                            "cause": [{"code": OK, "message": ""}]})
        else:
            records.append({"name": node.name, "type": node.op, "result": "failed",
                            "cause": [{"code": TYPE_UNSUPPORTED,
                                       "message": f"no kernel implements {domain}::{node.op}"}]})
    return records


def unsupported_types(records: list[dict]) -> list[str]:
    """Sorted distinct op types that failed the check."""
    return sorted({r["type"] for r in records if r["result"] != "success"})


def write_check_report(path: Path, model_name: str, records: list[dict]) -> None:
    """Write check_result.json."""
    failed = sum(r["result"] != "success" for r in records)
    report = {"name": model_name, "result": "failed" if failed else "success", "total": len(records),
              "pass": len(records) - failed, "fail": failed, "op": records}
    write_text(path, json.dumps(report, indent=4) + "\n")
