"""The tokenizer files that travel with a model: found by `--tokenizer` or beside the ONNX file."""

from __future__ import annotations

from pathlib import Path

from compiler.config import CompileConfig
from runtime.errors import AtcError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def tokenizer_files(cfg: CompileConfig) -> dict[str, str]:
    """Tokenizer files from `--tokenizer`, else from beside the model, else none."""
    folder = Path(cfg.tokenizer) if cfg.tokenizer else Path(cfg.model).parent
    if not (folder / "tokenizer.json").is_file():
        if cfg.tokenizer:
            raise AtcError("E10001", cfg.tokenizer, "--tokenizer", "The directory has no tokenizer.json.")
        return {}
    return {name: (folder / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES if (folder / name).is_file()}
