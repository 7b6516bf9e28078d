"""Export a Hugging Face causal LM to ONNX the way users do: `torch.onnx.export`, either exporter.

The graph's I/O follows Optimum's names so every runner speaks one language:
inputs `input_ids`, `attention_mask`, `position_ids` [, `past_key_values.{i}.key|value`],
outputs `logits` [, `present.{i}.key|value`]. KV tensors are [batch, kv_heads, seq, head_dim].
Torch is a model-preparation dependency only; nothing under `runtime/` imports this module.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

EXAMPLE_BATCH = 2
EXAMPLE_SEQ = 5
EXAMPLE_PAST = 3


class _CausalLMWithFlatCache(torch.nn.Module):
    """Turns the model's cache object into flat tensors, the only thing ONNX graphs can carry."""

    def __init__(self, model: torch.nn.Module, with_past: bool):
        super().__init__()
        self.model = model
        self.with_past = with_past

    def forward(self, input_ids, attention_mask, position_ids, *past):
        if not self.with_past:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            return out.logits
        from transformers import DynamicCache

        # layers that reuse an earlier layer's keys and values (Gemma 3n) have no cache of their own
        pairs = iter(zip(past[0::2], past[1::2]))
        data = [(None, None) if mode == "reuse" else next(pairs) for mode in _sharing_modes(self.model.config)]
        cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        # transformers renamed `past_key_values` to `cache` (5.2x); accept either spelling
        cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{cache_arg: cache})
        flat = []
        layers = (getattr(out, "cache", None) or out.past_key_values).layers
        for layer, mode in zip(layers, _sharing_modes(self.model.config)):
            if mode != "reuse":
                flat += [layer.keys, layer.values]
        return (out.logits, *flat)


class _CausalLMWithoutPositions(_CausalLMWithFlatCache):
    """The same, taking no position_ids: the model counts its positions itself, as when a user exports
    `input_ids` and the mask alone."""

    def forward(self, input_ids, attention_mask, *past):
        return super().forward(input_ids, attention_mask, None, *past)


def _sharing_modes(config) -> list[str | None]:
    """Each layer's KV sharing ("reuse": it attends to an earlier layer's keys and values and caches none)."""
    return list(getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers)


def cache_shapes(config) -> list[tuple[int, int]]:
    """(num_kv_heads, head_dim) of each layer with a cache of their own, in order: Gemma 4's full-attention
    layers have other sizes than its sliding ones (a heterogeneous config says so per layer)."""
    layers = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
    shapes = []
    for index, mode in enumerate(_sharing_modes(config)):
        layer = layers[index] if layers is not None else config
        heads = config.num_attention_heads
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        if mode != "reuse":
            shapes.append((kv_heads, getattr(layer, "head_dim", None) or config.hidden_size // heads))
    return shapes


def io_names(num_layers: int, with_past: bool) -> tuple[list[str], list[str]]:
    """The ONNX input and output names of an exported causal LM."""
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    if with_past:
        for i in range(num_layers):
            inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def example_inputs(config, with_past: bool, batch: int = EXAMPLE_BATCH, seq: int = EXAMPLE_SEQ,
                   past: int = EXAMPLE_PAST, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inputs that exercise every dynamic axis; right-padded last row so the mask matters; the past in `dtype`,
    the model's."""
    gen = torch.Generator().manual_seed(seed)
    past = past if with_past else 0
    feeds = {"input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=gen)}
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    if batch > 1:
        mask[-1, -1] = 0
    feeds["attention_mask"] = mask
    feeds["position_ids"] = torch.arange(past, past + seq).unsqueeze(0).repeat(batch, 1)
    if with_past:
        for i, (kv_heads, head_dim) in enumerate(cache_shapes(config)):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = torch.randn(batch, kv_heads, past, head_dim, generator=gen).to(dtype)
    return feeds


@contextmanager
def _logging_at(logger: logging.Logger, level: int):
    """`logger` at `level` for the block, then as it was."""
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def export_causal_lm(model: torch.nn.Module, path: str | os.PathLike, *, dynamo: bool, with_past: bool,
                     external_data: bool = False, opset: int | None = None, optimize: bool = True,
                     positions: bool = True) -> Path:
    """Export `model` to `path` (TorchScript at `opset`, 17 unless given; dynamo at `opset`, the exporter's
    default unless given, with its graph optimizer or, `optimize=False`, as traced; `positions=False`:
    without a position_ids input); the file is written atomically (temp name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    num_layers = len(cache_shapes(model.config))
    input_names, output_names = io_names(num_layers, with_past)
    if not positions:
        input_names.remove("position_ids")
    tokens = 3 if positions else 2  # inputs before the past
    feeds = example_inputs(model.config, with_past, dtype=next(model.parameters()).dtype)
    args = tuple(feeds[name] for name in input_names)
    wrapper = (_CausalLMWithFlatCache if positions else _CausalLMWithoutPositions)(model, with_past).eval()
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.partial.onnx")
    # notices a user cannot act on: torchvision's detection ops (which no LLM uses) left unregistered, and a
    # deprecation inside torch.export's own code
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    with torch.no_grad(), warnings.catch_warnings(), _logging_at(registration, logging.ERROR):
        if dynamo:
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            dynamic = torch.export.Dim.DYNAMIC
            # forward(*past) is one positional slot to torch.export: its shapes nest in a tuple
            past_shapes = tuple({0: dynamic, 2: dynamic} for _ in input_names[tokens:])
            shapes = ({0: dynamic, 1: dynamic},) * tokens + ((past_shapes,) if with_past else ())
            program = torch.onnx.export(
                wrapper, args, input_names=input_names, output_names=output_names,
                dynamic_shapes=shapes, dynamo=True, optimize=optimize,
                **({"opset_version": opset} if opset is not None else {}),
            )
            program.save(str(tmp), external_data=external_data)
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                    "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
            for name in input_names[tokens:]:
                axes[name] = {0: "batch", 2: "past"}
            for name in output_names[1:]:
                axes[name] = {0: "batch", 2: "total"}
            torch.onnx.export(
                wrapper, args, str(tmp), input_names=input_names, output_names=output_names,
                dynamic_axes=axes, opset_version=opset or 17, dynamo=False,
            )
            if external_data:
                import onnx

                proto = onnx.load(str(tmp))
                onnx.save(proto, str(tmp), save_as_external_data=True, location=path.name + ".data")
    _rename_with_data(tmp, path)
    return path


def _rename_with_data(tmp: Path, path: Path) -> None:
    """Move a finished export into place; external data keeps the name the graph refers to."""
    data = tmp.with_name(tmp.name + ".data")
    if data.exists():
        import onnx

        proto = onnx.load(str(tmp), load_external_data=False)
        for tensor in proto.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = path.name + ".data"
        data.replace(path.with_name(path.name + ".data"))
        onnx.save(proto, str(tmp))
    tmp.replace(path)
