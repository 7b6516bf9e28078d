"""Model-family recipes: what differs per family, and what its compiled graph must contain.

Detection (`detect_family`) reads the fused graph, so it keys on structure the passes found, never on
node or tensor names an exporter chose. Llama and Mistral share one structure (Mistral's sliding window
changes no op), so a Mistral graph is detected as llama; `--model_type=mistral` records it as such.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from cann_llm.passes.pattern import producer
from cann_llm.runtime.ops import ATTENTION_OPS, OPS


@dataclass(frozen=True)
class Recipe:
    """The structure of one family's decoder layer."""

    family: str
    rotary: str = "half"          # half, interleaved (GLM: pairs, on part of the head), learned (GPT-2)
    norms_per_layer: int = 2      # RMSNorms per layer; the final norm adds one
    gated_mlp: bool = True        # SiLU-gated MLP → SwiGlu
    attention: bool = True        # FusedAttention per layer
    moe: bool = False             # routed SwiGLU experts → one MoE per layer (router Softmax/TopK inside)
    exporters: tuple[str, ...] = ("ts", "dynamo")  # torch exporters that can export it

    def expected_counts(self, layers: int) -> dict[str, int]:
        """Fused-op counts a compile of a `layers`-layer model of this family must give."""
        return {"FusedAttention": layers if self.attention else 0,
                "norms": self.norms_per_layer * layers + 1 if self.norms_per_layer else 0,
                "SwiGlu": layers if self.gated_mlp else 0,
                "MoE": layers if self.moe else 0}


RECIPES: dict[str, Recipe] = {r.family: r for r in (
    Recipe("llama"),
    Recipe("llama_tied"),
    Recipe("mistral"),
    Recipe("qwen2"),
    Recipe("qwen3", norms_per_layer=4),   # per-head q and k norms stay RmsNorms feeding the attention
    Recipe("glm", rotary="interleaved", exporters=("dynamo",)),  # TorchScript fails on its repeat_interleave
    Recipe("phi3"),
    Recipe("gemma", gated_mlp=False),     # GELU MLP stays as exported
    Recipe("qwen2_moe", moe=True),        # the shared expert (outside the MoE op) is the SwiGlu
    Recipe("qwen3_moe", norms_per_layer=4, gated_mlp=False, moe=True),  # no shared expert: experts only
    Recipe("gpt2", rotary="learned", norms_per_layer=0, gated_mlp=False),  # LayerNorm, learned positions
)}


def detect_family(graph: gs.Graph) -> str:
    """The family a fused graph looks like (see the module note on llama and mistral)."""
    ops = Counter(node.op for node in graph.nodes)
    attention = next((node for node in graph.nodes if node.op in ATTENTION_OPS), None)
    if ops["LayerNormalization"] and not ops["RmsNorm"]:
        return "gpt2"
    if attention is None:
        return "unknown"
    if attention.attrs.get("rotary_interleaved"):
        return "glm"
    query = attention.inputs[OPS[attention.op].inputs.QUERY]
    merged = producer(query, "Reshape")
    if merged is not None and producer(merged.inputs[0], "RmsNorm") is not None:
        return "qwen3_moe" if ops["MoE"] or ops["TopK"] else "qwen3"
    if ops["MoE"] or ops["TopK"]:
        return "qwen2_moe"
    if not ops["SwiGlu"]:
        return "gemma"
    projection = producer(query, "Add", "MatMul")
    if projection is not None and projection.op == "Add":
        return "qwen2"
    if projection is not None and not projection.name.endswith("_qkv/MatMul"):
        return "phi3"  # the exporter's own packed projection, not one QkvFusionPass merged
    return "llama"
