"""`PagedConfig`: the paged KV cache's settings, from the soc profile and `--paged_config=paged.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.ops import PAGE_SIZE_RANGE

_JSON_KEYS = ("page_size",)


@dataclass(frozen=True)
class PagedConfig:
    """How the runtime pages the KV cache: tokens per page (a multiple of 16, 16 to 512)."""

    page_size: int = 128

    def __post_init__(self) -> None:
        low, high = PAGE_SIZE_RANGE
        size = self.page_size
        if isinstance(size, bool) or not isinstance(size, int) or not low <= size <= high or size % 16:
            raise invalid_value(size, "paged_config", f"page_size must be a multiple of 16 from {low} to {high}.")

    @classmethod
    def from_json(cls, path: str, default_page_size: int) -> "PagedConfig":
        """Read `path` (`{"page_size": 128}`); unknown keys and bad values get E10001, bad JSON E10032."""
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:
            raise AtcError("E10032", path, exc) from exc
        if not isinstance(data, dict):
            raise AtcError("E10032", path, "the top level must be a JSON object")
        unknown = sorted(set(data) - set(_JSON_KEYS))
        if unknown:
            raise invalid_value(", ".join(unknown), "paged_config", f"Unknown keys; the known ones are {', '.join(_JSON_KEYS)}.")
        return cls(page_size=data.get("page_size", default_page_size))
