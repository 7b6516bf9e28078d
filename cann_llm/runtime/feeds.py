"""Model inputs for `cann-run`: read from .npy/.bin files, or made up (zeros or random) from the signature.

A causal LM's inputs are made consistent with each other (attention_mask covers past + new tokens,
position_ids continue after the past, token ids fall inside the vocabulary), so a made-up run is a real
forward pass, not noise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ops import LAST_POSITIONS, paged_metadata_feeds
from cann_llm.runtime.signature import PAST_NAME, STATE_NAME

DEFAULT_DIM = 1
DEFAULT_SEQ = 16
MAX_POOL_BYTES = 1 << 36  # a pool for `cann-run run`: virtual memory, backed only where pages are written


def parse_shapes(text: str, flag: str = "--dymShape") -> dict[str, list[int]]:
    """`"input_ids:1,16;past_key_values.0.key:1,3,8,64"` → {name: dims}; `flag` names it in an error."""
    shapes = {}
    for item in filter(None, (text or "").split(";")):
        name, _, dims = item.rpartition(":")
        try:
            shapes[name] = [int(d) for d in dims.split(",") if d]
        except ValueError:
            raise AtcError("E10001", item, flag, "dims must be integers") from None
        if not name or any(d < 0 for d in shapes[name]):
            raise AtcError("E10001", item, flag, "expected name:d1,d2,... with dims >= 0")
    return shapes


def compiled_shapes(contract) -> dict[str, list[int]]:
    """The shapes an artifact compiled with `--input_shape` (its `ShapeContract`, or None) runs made-up inputs
    at: its smallest gear, else each input's fixed dims with a range's lowest value; an input with a free dim
    (-1) is left to the defaults."""
    if contract is None:
        return {}
    if contract.gears:
        smallest = min(contract.gears, key=lambda gear: sorted(int(np.prod(s)) for s in gear.values()))
        return {name: list(shape) for name, shape in smallest.items()}
    shapes = {}
    for name, dims in contract.input_shape.items():
        concrete = [d[0] if isinstance(d, list) else d for d in dims]
        if all(d >= 0 for d in concrete):
            shapes[name] = concrete
    return shapes


def _shape(value: dict, shapes: dict[str, list[int]]) -> list[int]:
    if value["name"] in shapes:
        return shapes[value["name"]]
    return [d if isinstance(d, int) and d >= 0 else DEFAULT_DIM for d in value["shape"]]


def read_input_files(paths: list[str], signature: dict, shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """One file per model input, in signature order; .npy carries its shape, .bin takes the model's."""
    inputs = signature["inputs"]
    if len(paths) != len(inputs):
        raise AtcError("E10001", ",".join(paths), "--input",
                       f"the model has {len(inputs)} inputs ({', '.join(v['name'] for v in inputs)}), "
                       f"{len(paths)} files were given")
    feeds = {}
    for path, value in zip(paths, inputs):
        dtype = np.dtype(value["dtype"])
        file = Path(path)
        if not file.is_file():
            raise AtcError("E13001", path, "Is a directory" if file.is_dir() else "No such file or directory")
        if file.suffix == ".npy":
            try:
                array = np.load(file, allow_pickle=False)
            except ValueError as error:
                raise AtcError("E10001", path, "--input", f"not a readable .npy file: {error}") from None
        else:
            array = np.fromfile(file, dtype=dtype)
            shape = _shape(value, shapes)
            if array.size != int(np.prod(shape)):
                raise AtcError("E10001", path, "--input", f"{array.size} {dtype} values do not fill shape {shape} "
                                                          f"of {value['name']}; give --dymShape")
            array = array.reshape(shape)
        if array.ndim != len(value["shape"]):
            raise AtcError("E10001", path, "--input", f"{value['name']} has {len(value['shape'])} dimensions "
                                                      f"{value['shape']}; the file holds {array.ndim} {list(array.shape)}")
        if array.dtype != dtype:
            raise AtcError("E10001", path, "--input", f"{value['name']} needs {dtype}, the file holds {array.dtype}")
        feeds[value["name"]] = array
    return feeds


def made_up_inputs(signature: dict, dims: dict, shapes: dict[str, list[int]], kind: str,
                   seed: int = 0, page_size: int | None = None) -> dict[str, np.ndarray]:
    """Zero or random inputs; a causal LM (`dims` with its vocabulary) gets a consistent set. For a paged artifact
    (`page_size`), `input_ids:B,S` in `shapes` means B sequences of S tokens each."""
    rng = np.random.default_rng(seed)
    if "vocab_size" in dims:  # a causal LM (any artifact's dims also name its family)
        batch, seq = shapes.get("input_ids", [DEFAULT_DIM, DEFAULT_SEQ])
        past = shapes.get("past_key_values.0.key", [batch, 0, 0, 0])[2]
        if kind == "zero":
            ids = np.zeros((batch, seq), np.int64)
        else:
            ids = rng.integers(0, dims["vocab_size"], (batch, seq), dtype=np.int64)
        return causal_lm_inputs(signature, dims, ids, past, rng if kind == "random" else None, page_size)
    feeds = {}
    for value in signature["inputs"]:
        shape, dtype = _shape(value, shapes), np.dtype(value["dtype"])
        if kind == "zero":
            feeds[value["name"]] = np.zeros(shape, dtype)
        elif dtype.kind == "f":
            feeds[value["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[value["name"]] = rng.integers(0, 2, shape).astype(dtype)
        else:
            feeds[value["name"]] = rng.integers(0, 10, shape).astype(dtype)
    return feeds


def causal_lm_inputs(signature: dict, dims: dict, ids: np.ndarray, past: int = 0,
                     rng: np.random.Generator | None = None, page_size: int | None = None) -> dict[str, np.ndarray]:
    """Feeds for token `ids` [batch, seq] after `past` cached positions (zeros, or random with `rng`).

    A paged artifact (`page_size` given) takes each row as one sequence of its flattened step, with the
    attention metadata for pages numbered from 0 (`page_pool` makes a pool that holds them).
    """
    if page_size is not None:
        return _paged_inputs(signature, ids, past, page_size)
    batch, seq = ids.shape
    names = {value["name"]: value for value in signature["inputs"]}
    feeds = {"input_ids": ids}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((batch, past + seq), np.dtype(names["attention_mask"]["dtype"]))
    if "position_ids" in names:
        positions = np.arange(past, past + seq, dtype=np.dtype(names["position_ids"]["dtype"]))
        feeds["position_ids"] = np.broadcast_to(positions, (batch, seq)).copy()
    feeds.update(zero_states(signature, batch))
    for name, value in names.items():
        dtype = np.dtype(value["dtype"])
        if PAST_NAME.match(name) and dims.get("kv_cache_io"):
            # each input's own static sizes where it has them: layers may differ (Gemma 4)
            declared = value["shape"]
            heads, size = (d if isinstance(d, int) else default for d, default in
                           zip((declared[1], declared[3]), (dims["num_kv_heads"], dims["head_dim"])))
            shape = (batch, heads, past, size)
            feeds[name] = (rng.standard_normal(shape).astype(dtype) if rng is not None else np.zeros(shape, dtype))
    return feeds


def _paged_inputs(signature: dict, ids: np.ndarray, past: int, page_size: int) -> dict[str, np.ndarray]:
    batch, seq = ids.shape
    context = past + seq
    pages = -(-context // page_size)
    tables = np.arange(batch * pages, dtype=np.int64).reshape(batch, pages)
    positions = np.arange(past, context)
    slots = (tables[:, positions // page_size] * page_size + positions % page_size).reshape(-1)
    feeds = {"input_ids": ids.reshape(1, -1).astype(np.int64),
             "position_ids": np.tile(positions, batch)[None].astype(np.int64),
             **paged_metadata_feeds(np.arange(batch + 1) * seq, np.full(batch, context), tables, slots)}
    names = {value["name"] for value in signature["inputs"]}
    if "logits_indices" in names:
        feeds["logits_indices"] = np.arange(1, batch + 1, dtype=np.int64) * seq - 1
    if LAST_POSITIONS in names:  # every row's sequence ends at its last position
        feeds[LAST_POSITIONS] = np.full((1, batch * seq), context - 1, np.int64)
    feeds.update(zero_states(signature, batch))
    return feeds


def zero_states(signature: dict, batch: int) -> dict[str, np.ndarray]:
    """A hybrid's recurrent states (`past.N.conv|recurrent`) before the first token, for `batch` sequences:
    zeros (nothing for a model without them)."""
    return {value["name"]: np.zeros((batch, *value["shape"][1:]), np.dtype(value["dtype"]))
            for value in signature["inputs"] if STATE_NAME.match(value["name"])}


def page_pool(metadata: dict, feeds: dict[str, np.ndarray]) -> PagePool:
    """A page pool for a paged artifact just large enough for the pages `feeds` address (at least one)."""
    dims, page_size = metadata["model"], metadata["kv_cache"]["page_size"]
    tables, slots = feeds.get("block_tables"), feeds.get("slot_mapping")
    highest = max([int(a.max()) + 1 for a in (tables,) if a is not None and a.size] +
                  [int(a.max()) // page_size + 1 for a in (slots,) if a is not None and a.size] + [1])
    per_page = PagePool.bytes_per_page(dims, page_size)
    if highest * per_page > MAX_POOL_BYTES:
        raise AtcError("E10001", highest - 1, "--input", f"the block tables or slots address page {highest - 1}; "
                                                         f"a pool that large ({highest * per_page} bytes) is refused")
    return PagePool.of(dims, highest, page_size)
