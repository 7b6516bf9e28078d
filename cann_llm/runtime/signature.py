"""What the artifact's metadata says about a graph: its I/O signature and LLM dimensions."""

from __future__ import annotations

import re

import onnx
from onnx import helper

PAST_NAME = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
# a recurrent layer's state of fixed size (a hybrid's convolution or gated delta net; onnxruntime-genai's names)
STATE_NAME = re.compile(r"^past\.(\d+)\.(conv|recurrent)$")
# what a contiguous artifact's engine feeds besides the cache
CONTIGUOUS_INPUTS = ("input_ids", "attention_mask", "position_ids")


def present_name(past: str) -> str:
    """The output that gives back the cache input `past` (past_key_values.N.key → present.N.key,
    past.N.conv → present.N.conv)."""
    return "present" + past[len("past" if STATE_NAME.match(past) else "past_key_values"):]


def is_state(name: str) -> bool:
    """Whether graph input or output `name` is a recurrent state (`past.N.conv`, `present.N.recurrent`)."""
    return bool(STATE_NAME.match(name.replace("present.", "past.", 1)))


def is_carried(name: str) -> bool:
    """Whether input `name` is something a step gives back for the next: a KV cache or a recurrent state."""
    return bool(PAST_NAME.match(name) or STATE_NAME.match(name))


def _value(value: onnx.ValueInfoProto) -> dict:
    tensor_type = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or -1) for d in tensor_type.shape.dim]
    return {"name": value.name, "dtype": helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name, "shape": dims}


def io_signature(model: onnx.ModelProto) -> dict:
    """Inputs and outputs in order, with dtype and shape (a name for a symbolic dim)."""
    initializers = {t.name for t in model.graph.initializer}
    return {"inputs": [_value(v) for v in model.graph.input if v.name not in initializers],
            "outputs": [_value(v) for v in model.graph.output]}


def is_dynamic(signature: dict) -> bool:
    """ATC's is_unknow_model: some input has a dimension not fixed at compile time."""
    return any(not isinstance(d, int) or d < 0 for value in signature["inputs"] for d in value["shape"])


def fixed_token_shape(signature: dict) -> list[int] | None:
    """`input_ids`' shape when every dim of it is fixed (an export made without dynamic axes, or
    `--input_shape` fixing them): such a graph runs that one shape, and generating needs others."""
    shape = next((value["shape"] for value in signature["inputs"] if value["name"] == "input_ids"), None)
    return shape if shape is not None and is_fixed(shape) else None


def is_fixed(shape) -> bool:
    """Whether every dim of `shape` (ints, or names of symbolic dims) is a known positive size."""
    return bool(shape) and all(isinstance(dim, int) and dim > 0 for dim in shape)


def llm_dimensions(signature: dict) -> dict:
    """Layers, KV heads, head size and vocabulary of a causal LM with Optimum-style I/O (empty if not one); with
    past inputs of different sizes, `layer_kv`: each one's [KV heads, head size]. A hybrid's `num_layers` counts
    its attention layers (those with keys and values); `recurrent_layers` its layers with a state."""
    inputs = {v["name"]: v for v in signature["inputs"]}
    outputs = {v["name"]: v for v in signature["outputs"]}
    if "input_ids" not in inputs or "logits" not in outputs:
        return {}
    layers = {int(m.group(1)) for name in inputs if (m := PAST_NAME.match(name))}
    recurrent = {int(m.group(1)) for name in inputs if (m := STATE_NAME.match(name))}
    dims = {"vocab_size": outputs["logits"]["shape"][-1], "kv_cache_io": bool(layers)}
    if recurrent:
        dims["recurrent_layers"] = len(recurrent)
    if layers:
        past = inputs[f"past_key_values.{min(layers)}.key"]["shape"]
        dims.update(num_layers=len(layers), num_kv_heads=past[1], head_dim=past[3])
        # each cache's sizes where they differ (Gemma 4's full layers against its sliding ones)
        sizes = [[inputs[f"past_key_values.{i}.key"]["shape"][d] for d in (1, 3)] for i in sorted(layers)
                 if f"past_key_values.{i}.key" in inputs]
        if any(size != sizes[0] for size in sizes):
            dims["layer_kv"] = sizes
    return dims
