"""Who may call, how much, what is recorded, and what may not be said: API keys, token quotas, the audit
log and the content filter."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

from cann_llm.runtime.safe_files import open_append


def key_id(key: str | None) -> str:
    """A stable, non-reversible name for a key in logs (never the key itself)."""
    return "anonymous" if key is None else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class Guard:
    """API keys with optional per-key token quotas, a JSON-lines audit log, a block-list content filter."""

    def __init__(self, api_keys: list[str] | None = None, quota_tokens: int | None = None,
                 audit_log: str | None = None, blocklist: str | None = None):
        self.api_keys = set(api_keys or [])
        self.quota_tokens = quota_tokens
        self.used: dict[str, int] = {}
        self.blocked_terms = tuple(line.strip() for line in Path(blocklist).read_text(encoding="utf-8").splitlines()
                                   if line.strip()) if blocklist else ()
        self._audit = open_append(audit_log) if audit_log else None
        self._lock = threading.Lock()

    def authorise(self, header: str | None) -> tuple[str | None, str | None]:
        """(key, None) when the call may go on, else (None, reason) for a 401."""
        if not self.api_keys:
            return None, None
        key = self.presented_key(header)
        if key not in self.api_keys:
            return None, "a valid API key is required (Authorization: Bearer <key>)"
        return key, None

    def presented_key(self, header: str | None) -> str | None:
        """The key a request presents, valid or not (for the audit log, which records it hashed)."""
        return header[len("Bearer "):].strip() if header and header.startswith("Bearer ") else None

    def reserve(self, key: str | None, tokens: int) -> int | None:
        """Set `tokens` of `key`'s quota aside for a request, unless fewer are left: then the number left
        (and nothing reserved). Checked and taken in one step, so concurrent requests cannot overdraw it."""
        if self.quota_tokens is None or key is None:
            return None
        with self._lock:
            left = self.quota_tokens - self.used.get(key, 0)
            if tokens > left:
                return max(0, left)
            self.used[key] = self.used.get(key, 0) + tokens
        return None

    def refund(self, key: str | None, tokens: int) -> None:
        """Give back reserved tokens a request did not use."""
        if self.quota_tokens is not None and key is not None:
            with self._lock:
                self.used[key] -= tokens

    def blocked(self, text: str) -> str | None:
        """The first block-listed term in `text` (case-insensitive), if any."""
        lowered = text.lower()
        return next((term for term in self.blocked_terms if term.lower() in lowered), None)

    def audit(self, key: str | None, model: str, endpoint: str, status: int, tokens_in: int = 0, tokens_out: int = 0,
              latency_s: float = 0.0) -> None:
        """One JSON line per request: time, key id, model, tokens in and out, latency, status."""
        if self._audit is None:
            return
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "key_id": key_id(key), "model": model,
                  "endpoint": endpoint, "status": status, "tokens_in": tokens_in, "tokens_out": tokens_out,
                  "latency_ms": round(latency_s * 1000, 1)}
        with self._lock:
            self._audit.write(json.dumps(record) + "\n")
            self._audit.flush()

    def close(self) -> None:
        if self._audit is not None:
            self._audit.close()
