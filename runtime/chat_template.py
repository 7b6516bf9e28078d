"""The model's chat template (jinja2, as Hugging Face renders it), from the artifact's tokenizer files."""

from __future__ import annotations

import json

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.errors import AtcError


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    """Renders `messages` into the prompt text the model was trained on."""

    def __init__(self, files: dict[str, str]):
        config = json.loads(files.get("tokenizer_config.json", "{}"))
        source = files.get("chat_template.jinja") or config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            raise AtcError("E10001", "chat", "--model", "The model was compiled without a chat template; "
                                                      "recompile with atc --tokenizer=DIR holding tokenizer_config.json.")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` ([{"role": ..., "content": ...}]), ending where the assistant speaks."""
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError("each message must be a dict with 'role' and 'content'")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._special)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
