"""Runs inside the optimum venv (transformers 4.57, optimum-onnx), never in the project's own venv.

    python -m models.optimum_worker SEED FAMILY CHECKPOINT OUTPUT [FAMILY CHECKPOINT OUTPUT ...]

exports each checkpoint folder with Optimum's `text-generation-with-past` task into OUTPUT; CHECKPOINT
`build` builds the tiny model here first (models.tiny.build_tiny_model, same sizes and seed).
"""

from __future__ import annotations

import sys
import tempfile


def export(family: str, checkpoint: str, output: str, seed: int) -> None:
    """Optimum's export of one checkpoint, as `optimum-cli export onnx --task text-generation-with-past`."""
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory() as scratch:
        if checkpoint == "build":
            from models.tiny import build_tiny_model

            checkpoint = f"{scratch}/{family}"
            build_tiny_model(family, seed).save_pretrained(checkpoint)
        main_export(checkpoint, output=output, task="text-generation-with-past", device="cpu")


def main(argv: list[str]) -> None:
    seed, jobs = int(argv[0]), argv[1:]
    for index in range(0, len(jobs), 3):
        export(jobs[index], jobs[index + 1], jobs[index + 2], seed)


if __name__ == "__main__":
    main(sys.argv[1:])
