"""Load a `.om` for execution: map the file, check every op has a kernel, hand out zero-copy weights."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx

from runtime.artifact import OmFile
from runtime.errors import AtcError
from runtime.kernels import supports


@dataclass
class LoadedModel:
    """An artifact ready to execute: the graph, weight views into the mapped file, and metadata."""

    om: OmFile
    model: onnx.ModelProto
    weights: dict[str, np.ndarray]
    metadata: dict

    @property
    def input_names(self) -> list[str]:
        return [value["name"] for value in self.metadata["signature"]["inputs"]]

    @property
    def output_names(self) -> list[str]:
        return [value["name"] for value in self.metadata["signature"]["outputs"]]

    @property
    def kv_cache(self) -> dict:
        """The KV layout the artifact was compiled for: `{"layout": "contiguous"}` (past/present graph I/O)
        or `{"layout": "paged", "page_size": P}` (the runtime's page pool, PagedAttention nodes)."""
        return self.metadata.get("kv_cache", {"layout": "contiguous"})

    @property
    def paged(self) -> bool:
        """Whether the artifact runs over a page pool the runtime owns."""
        return self.kv_cache["layout"] == "paged"


def load_artifact(path: str | os.PathLike, verify_weights: bool = True) -> LoadedModel:
    """Open and validate `path`; refuses truncated, corrupted, foreign or unrunnable files (AtcError)."""
    om = OmFile(path, verify_weights=verify_weights)
    model = om.graph()
    missing = sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node if not supports(n.domain, n.op_type)})
    if missing:
        raise AtcError("E16002", ", ".join(missing))
    return LoadedModel(om=om, model=model, weights=om.weights(model), metadata=om.metadata)
