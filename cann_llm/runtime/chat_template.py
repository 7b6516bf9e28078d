"""The model's chat template, rendered as transformers' `apply_chat_template` renders it: the same sandboxed
jinja2 environment (loop controls, `{% generation %}` blocks, its `tojson`, `raise_exception`,
`strftime_now`) and the same variables (`messages`, `tools`, `add_generation_prompt`, the special tokens)."""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cann_llm.runtime.errors import AtcError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' own: jinja's built-in tojson escapes <, >, & and ' for HTML, which prompts must not have
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


NO_TEMPLATE = ("chat needs a chat template, and the model was compiled without one (its tokenizer folder had no "
               "chat_template.jinja and no chat_template in tokenizer_config.json): give one with --chat_template_file "
               "(chat_template_file= in Python), or compile again with atc --tokenizer=DIR of a folder that has one")


class ChatTemplate:
    """Renders `messages` into the prompt text the model was trained on."""

    def __init__(self, files: dict[str, str]):
        config = json.loads(files.get("tokenizer_config.json", "{}"))
        source = files.get("chat_template.jinja") or config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            raise AtcError("E10055", NO_TEMPLATE)
        self._template = compile_template(source)
        self.renders_tools = "tools" in source
        self._source = source
        self._special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS if config.get(name)}

    def takes_role(self, role) -> bool:
        """Whether messages of `role` are rendered: OpenAI's roles, or one the template names (Llama 3.1's
        `ipython`, GLM's `observation`)."""
        return role in ROLES or isinstance(role, str) and any(f"{q}{role}{q}" in self._source for q in "'\"")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt for `messages` ([{"role": ..., "content": ...}]), ending where the assistant speaks,
        with `tools` (OpenAI's function definitions) where the template renders them."""
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError("each message must be a dict with 'role' and 'content'")
            if not self.takes_role(message["role"]):
                raise ValueError(f"a message's role is one of {', '.join(ROLES)} (or one the chat template names), "
                                 f"not {message['role']!r}")
        messages = [{**m, "content": content_text(m["content"])} for m in messages]
        return self._template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special)


# OpenAI's roles, which chat templates are written for (one a template does not know it renders as it likes)
ROLES = ("system", "developer", "user", "assistant", "tool")


def content_text(content) -> str:
    """A message's content as one text, as templates that do not loop over parts expect: OpenAI's content
    parts (`[{"type": "text", "text": ...}]`) joined, None (an assistant turn of tool calls only) empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError("a message's content is a string, a list of text parts ({'type': 'text', 'text': ...}) or None")


def compile_template(source: str):
    """`source` compiled in transformers' chat-template environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
