"""Calibration windows: the calibration text's token ids cut into windows of `seq_len` tokens, none longer
than the model reads.

A model says how many positions it reads in its Hugging Face config.json (`max_position_embeddings`, GPT-2's
`n_positions`) and, where it looks positions up in a table (GPT-2's learned ones, a rotary cache stored
whole), in the table's rows. A window past either would calibrate on positions the model never learned or
index past its table, so a `seq_len` given longer is E10001, and the default is cut to fit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from cann_llm.passes.graph_utils import position_table_rows
from cann_llm.passes.quant.config import DEFAULT_SEQ_LEN, QuantConfig
from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.safe_files import read_text

POSITION_KEYS = ("max_position_embeddings", "n_positions")


def declared_positions(model: str | Path) -> tuple[int, str] | None:
    """The positions the config.json beside `model` declares, and where it says so; None without one."""
    path = Path(model).parent / "config.json"
    if not path.is_file():
        return None
    try:
        document = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise AtcError("E10032", path, error) from None
    for key in POSITION_KEYS if isinstance(document, dict) else ():
        value = document.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{key} in {path}"
    return None


def window_length(config: QuantConfig, positions: tuple[int, str] | None) -> int:
    """Tokens per window: `seq_len` as given, E10001 past the model's `positions` (how many, and where that
    is said); not given, DEFAULT_SEQ_LEN or the positions when fewer."""
    if positions is None:
        return config.seq_len or DEFAULT_SEQ_LEN
    limit, source = positions
    if config.seq_len is None:
        return min(DEFAULT_SEQ_LEN, limit)
    if config.seq_len > limit:
        raise invalid_value(config.seq_len, config.parameter("seq_len"),
                            f"The model reads at most {limit} positions ({source}); a calibration window cannot "
                            f"be longer.")
    return config.seq_len


def text_samples(token_ids: list[int], num_samples: int, seq_len: int) -> list[np.ndarray]:
    """Consecutive, non-overlapping windows of `seq_len` tokens; as many as asked and the text allows."""
    count = min(num_samples, len(token_ids) // seq_len)
    return [np.asarray(token_ids[i * seq_len:(i + 1) * seq_len], np.int64) for i in range(count)]


def within_positions(graph: gs.Graph, samples: list[np.ndarray], config: QuantConfig) -> list[np.ndarray]:
    """`samples` cut to the rows of the table the graph reads at each position, where it has one (E10001 for
    a `seq_len` given longer): before anything runs them."""
    rows = position_table_rows(graph)
    if rows is None:
        return samples
    length = window_length(config, (rows, "the rows of its position table"))
    return [sample[:length] for sample in samples]
