"""Export a Hugging Face causal LM to ONNX the way users do: `torch.onnx.export`, either exporter.

The graph's I/O follows Optimum's names so every runner speaks one language:
inputs `input_ids`, `attention_mask`, `position_ids` [, `past_key_values.{i}.key|value`],
outputs `logits` [, `present.{i}.key|value`]. KV tensors are [batch, kv_heads, seq, head_dim]. A hybrid model's
recurrent layers carry `past.{i}.conv` [, `past.{i}.recurrent`] instead (cann_llm/models/recurrent_export.py).
Torch is a model-preparation dependency only; nothing under `runtime/` imports this module.
"""

from __future__ import annotations

import logging
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from cann_llm.models.real_rotary import rotary_in_real_arithmetic
from cann_llm.models.recurrent_export import (NO_CACHE_TYPES, PARALLEL_TYPES, cache_argument, computes_gated_delta_rule,
                                              dynamo_translations, load_states, read_states, recurrent_layers,
                                              register_torchscript_symbolic, routed_through_onnxruntime,
                                              state_shapes)
from cann_llm.runtime.signature import is_state

EXAMPLE_BATCH = 2
EXAMPLE_SEQ = 5
EXAMPLE_PAST = 3


class _CausalLMWithFlatCache(torch.nn.Module):
    """Turns the model's cache object into flat tensors, the only thing ONNX graphs can carry: in layer order,
    a key and a value for an attention layer, the states of `states` (see `state_shapes`) for a recurrent one."""

    def __init__(self, model: torch.nn.Module, with_past: bool, states: dict | None = None):
        super().__init__()
        self.model = model
        self.with_past = with_past
        self.states = states or {}

    def forward(self, input_ids, attention_mask, position_ids, *past):
        if not self.with_past:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            return out.logits
        from transformers import DynamicCache

        flat = iter(past)
        data, loaded = [], {}
        for index, own in enumerate(_own_kv(self.model.config)):
            data.append((next(flat), next(flat)) if own else (None, None))
            if index in self.states:
                loaded[index] = {kind: next(flat) for kind in self.states[index]}
        cache = DynamicCache(ddp_cache_data=data, config=self.model.config)
        load_states(cache, loaded)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{cache_argument(self.model): cache})
        cache = getattr(out, "cache", None) or out.past_key_values
        states = read_states(cache, self.states)
        given = []
        for index, (layer, own) in enumerate(zip(cache.layers, _own_kv(self.model.config))):
            if own:
                given += [layer.keys, layer.values]
            if index in states:
                given += states[index].values()
        return (out.logits, *given)


class _CausalLMWithoutPositions(_CausalLMWithFlatCache):
    """The same, taking no position_ids: the model counts its positions itself, as when a user exports
    `input_ids` and the mask alone."""

    def forward(self, input_ids, attention_mask, *past):
        return super().forward(input_ids, attention_mask, None, *past)


KV = ("key", "value")


def _own_kv(config) -> list[bool]:
    """Whether each layer keeps keys and values of its own: not a recurrent layer (but one with attention beside
    its recurrence), not one that attends to an earlier layer's (Gemma 3n's KV sharing), not one without
    attention (Nemotron-H's MLP and MoE layers, to which transformers gives a DummyLayer)."""
    modes = getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    recurrent = recurrent_layers(config)
    return [mode != "reuse" and kind not in NO_CACHE_TYPES and (index not in recurrent or kind in PARALLEL_TYPES)
            for index, (mode, kind) in enumerate(zip(modes, types))]


def cache_shapes(config) -> list[tuple[int, int, int]]:
    """(num_kv_heads, key size, value size) of each attention layer with a cache of its own, in order: Gemma 4's
    full-attention layers have other sizes than its sliding ones (a heterogeneous config says so per layer);
    multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash) computes its keys' no-rotation and
    rotated parts in one latent: transformers caches the latent (`kv_lora_rank`) as the key and the rotated part
    (`qk_rope_head_dim`) as the value, one head of each, and expands them at every step."""
    layers = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
    shapes = []
    for index, own in enumerate(_own_kv(config)):
        layer = layers[index] if layers is not None else config
        heads = config.num_attention_heads
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        if own:
            size = getattr(layer, "head_dim", None) or config.hidden_size // heads
            latent = getattr(layer, "kv_lora_rank", None)
            shapes.append((1, latent, layer.qk_rope_head_dim) if latent else (kv_heads, size, size))
    return shapes


def cache_layers(config, states: dict | None = None) -> list[tuple[int, tuple[str, ...]]]:
    """(layer index, what it caches) of each layer that caches something, in order: its key and value, then a
    recurrent layer's states (`states`, see `state_shapes`)."""
    states = states or {}
    return [(index, (KV if own else ()) + tuple(states.get(index, ())))
            for index, own in enumerate(_own_kv(config)) if own or index in states]


def _layer_names(layer: int, kinds) -> list[tuple[str, str]]:
    """(input, output) names of one layer's cache tensors: its key and value, a recurrent layer's states."""
    return [(f"{'past_key_values' if kind in KV else 'past'}.{layer}.{kind}", f"present.{layer}.{kind}")
            for kind in kinds]


def io_names(layers: int | list[tuple[int, tuple[str, ...]]], with_past: bool) -> tuple[list[str], list[str]]:
    """The ONNX input and output names of an exported causal LM whose layers that cache something are `layers`
    (see `cache_layers`; a count: that many layers of keys and values)."""
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    if with_past:
        for index, kinds in ([(i, KV) for i in range(layers)] if isinstance(layers, int) else layers):
            for past, present in _layer_names(index, kinds):
                inputs.append(past)
                outputs.append(present)
    return inputs, outputs


def cache_entries(config, states: dict | None = None) -> list[tuple[str, str, tuple]]:
    """(input, output, shape without the batch axis) of each cache tensor in graph order: a key or value
    [kv_heads, None, head_dim], None its sequence axis; a recurrent layer's state its fixed shape."""
    kv = iter(cache_shapes(config))
    entries = []
    for index, kinds in cache_layers(config, states):
        if kinds[:2] == KV:
            heads, *sizes = next(kv)
            kv_shapes = {kind: (heads, None, size) for kind, size in zip(KV, sizes)}
        entries += [(past, present, kv_shapes[kind] if kind in KV else tuple(states[index][kind]))
                    for kind, (past, present) in zip(kinds, _layer_names(index, kinds))]
    return entries


def example_inputs(config, with_past: bool, batch: int = EXAMPLE_BATCH, seq: int = EXAMPLE_SEQ,
                   past: int = EXAMPLE_PAST, seed: int = 0, dtype: torch.dtype = torch.float32,
                   states: dict | None = None) -> dict[str, torch.Tensor]:
    """Inputs that exercise every dynamic axis; right-padded last row so the mask matters; the past in `dtype`,
    the model's (a recurrent state in float32, as the op keeps it)."""
    gen = torch.Generator().manual_seed(seed)
    past = past if with_past else 0
    feeds = {"input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=gen)}
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    if batch > 1:
        mask[-1, -1] = 0
    feeds["attention_mask"] = mask
    feeds["position_ids"] = torch.arange(past, past + seq).unsqueeze(0).repeat(batch, 1)
    if with_past:
        for name, _, shape in cache_entries(config, states):
            sizes = [past if size is None else size for size in shape]
            kind_dtype = torch.float32 if name.endswith(".recurrent") else dtype
            feeds[name] = torch.randn(batch, *sizes, generator=gen).to(kind_dtype)
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
    states = state_shapes(model)
    if not dynamo and computes_gated_delta_rule(model):
        raise NotImplementedError("TorchScript writes transformers' split of a gated delta net's tokens "
                                  "(torch.tensor_split) as a Tile that onnxruntime refuses")
    input_names, output_names = io_names(cache_layers(model.config, states), with_past)
    if not positions:
        input_names.remove("position_ids")
    tokens = 3 if positions else 2  # inputs before the past
    feeds = example_inputs(model.config, with_past, dtype=next(model.parameters()).dtype, states=states)
    args = tuple(feeds[name] for name in input_names)
    wrapper = (_CausalLMWithFlatCache if positions else _CausalLMWithoutPositions)(model, with_past, states).eval()
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.partial.onnx")
    # notices a user cannot act on: torchvision's detection ops (which no LLM uses) left unregistered, and a
    # deprecation inside torch.export's own code
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    with (torch.no_grad(), warnings.catch_warnings(), _logging_at(registration, logging.ERROR),
          routed_through_onnxruntime(model), rotary_in_real_arithmetic(model)):
        if dynamo:
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            dynamic = torch.export.Dim.DYNAMIC
            # forward(*past) is one positional slot to torch.export: its shapes nest in a tuple; a state has
            # no sequence axis
            past_shapes = tuple({0: dynamic} if is_state(name) else {0: dynamic, 2: dynamic}
                                for name in input_names[tokens:])
            shapes = ({0: dynamic, 1: dynamic},) * tokens + ((past_shapes,) if with_past else ())
            program = torch.onnx.export(
                wrapper, args, input_names=input_names, output_names=output_names,
                dynamic_shapes=shapes, dynamo=True, optimize=optimize,
                custom_translation_table=dynamo_translations() if states else None,
                **({"opset_version": opset} if opset is not None else {}),
            )
            program.save(str(tmp), external_data=external_data)
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                    "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
            for name in input_names[tokens:]:
                axes[name] = {0: "batch"} if is_state(name) else {0: "batch", 2: "past"}
            for name in output_names[1:]:
                axes[name] = {0: "batch"} if is_state(name) else {0: "batch", 2: "total"}
            if states:
                register_torchscript_symbolic(opset or 17)
            torch.onnx.export(
                wrapper, args, str(tmp), input_names=input_names, output_names=output_names,
                dynamic_axes=axes, opset_version=opset or 17, dynamo=False,
                **({"custom_opsets": {"com.microsoft": 1}} if states else {}),
            )
            if states:
                _declare_outputs(tmp, model, with_past, states)
            if external_data:
                import onnx

                proto = onnx.load(str(tmp))
                onnx.save(proto, str(tmp), save_as_external_data=True, location=path.name + ".data")
    _rename_with_data(tmp, path)
    return path


def _declare_outputs(path: Path, model: torch.nn.Module, with_past: bool, states: dict) -> None:
    """Give a TorchScript export of a hybrid its outputs' shapes, and no inferred ones. TorchScript's shape
    inference knows no contrib op: past onnxruntime's recurrent ops it names every dim it cannot follow
    (`MatMullogits_dim_2` for the vocabulary), and a compiler must take a declared output's dims as given."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    vocabulary = getattr(model.get_output_embeddings(), "out_features", None) or model.config.vocab_size
    shapes = {"logits": ["batch", "seq", vocabulary]}
    if with_past:
        shapes.update({present: ["batch", *("total" if size is None else size for size in shape)]
                       for _, present, shape in cache_entries(model.config, states)})
    for output in proto.graph.output:
        dims = output.type.tensor_type.shape.dim
        for dim, wanted in zip(dims, shapes[output.name]):
            if isinstance(wanted, int):
                dim.Clear()
                dim.dim_value = wanted
            else:
                dim.dim_param = wanted
    del proto.graph.value_info[:]
    onnx.save(proto, str(path))


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
