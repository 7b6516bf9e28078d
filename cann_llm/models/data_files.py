"""The texts shipped in cann_llm/models/data: the default calibration text and the held-out evaluation text."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CALIBRATION_TEXT = DATA_DIR / "calibration.txt"
EVAL_TEXT = DATA_DIR / "eval.txt"
