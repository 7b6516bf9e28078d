"""The tokenizer files that travel with a model: found by `--tokenizer` or beside the ONNX file.

Each file must resolve inside that folder: a `tokenizer.json` symlinked to a file elsewhere (another
user's, or /etc/shadow) would otherwise be read and embedded in an artifact that is then handed on. The one
exception is the layout of a Hugging Face cache, whose `snapshots/<revision>/` files link into the same
repository's `blobs/`.
"""

from __future__ import annotations

import json
from pathlib import Path

from cann_llm.compiler.config import CompileConfig
from cann_llm.runtime.errors import AtcError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
JSON_FILES = frozenset(name for name in TOKENIZER_FILES if name.endswith(".json"))


def tokenizer_files(cfg: CompileConfig) -> dict[str, str]:
    """Tokenizer files from `--tokenizer`, else from beside the model, else none; each read as UTF-8 from
    inside the folder (E13001 otherwise) and, for the JSON ones, parsed (E10032 otherwise)."""
    folder = Path(cfg.tokenizer) if cfg.tokenizer else Path(cfg.model).parent
    if not (folder / "tokenizer.json").is_file():
        if cfg.tokenizer:
            raise AtcError("E10001", cfg.tokenizer, "--tokenizer", "The directory has no tokenizer.json.")
        return {}
    return {name: _read_inside(folder, name) for name in TOKENIZER_FILES if (folder / name).is_file()}


def _read_inside(folder: Path, name: str) -> str:
    path = folder / name
    real = path.resolve()
    if real.parent not in _allowed_folders(folder):
        raise AtcError("E13001", path, f"the file resolves to {real}, outside the model folder {folder}")
    try:
        text = real.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise AtcError("E13001", path, f"the file is not UTF-8 text: {error}") from None
    except OSError as error:
        raise AtcError("E13001", path, error.strerror) from None
    if name in JSON_FILES:
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            raise AtcError("E10032", path, error) from None
    return text


def _allowed_folders(folder: Path) -> set[Path]:
    """Where the files of `folder` may really live: the folder itself, and for a Hugging Face cache snapshot
    (`models--org--name/snapshots/<revision>`) that repository's `blobs` folder."""
    real = folder.resolve()
    allowed = {real}
    if folder.absolute().parent.name == "snapshots":
        allowed.add((folder.absolute().parent.parent / "blobs").resolve())
    return allowed
