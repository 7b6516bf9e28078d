"""Tool calling in chat completions: the constraint a `tool_choice` puts on the output, the tools described to
a model whose chat template does not render them, and the tool calls read back out of the text.

- `tool_choice` a named function: the output is that function's arguments, generated under its JSON schema.
- `required`: the output is a JSON array of calls `[{"name": ..., "parameters": {...}}]`, each under its
  function's schema (one call when `parallel_tool_calls` is false), as vLLM constrains it.
- `auto`: the model decides; calls are read from what it wrote, in the spellings chat templates teach:
  `<tool_call>{...}</tool_call>` blocks (Hermes, Qwen 2.5), a bare JSON object or array of calls (Llama 3.x),
  `[TOOL_CALLS] [...]` (Mistral). Text that parses as none of them is the answer's content.
- `none`: tools are described, nothing is constrained or read.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from cann_llm.runtime.engine.structured import StructuredOutput

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a fresh id, the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        said = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return said if index is None else {"index": index, **said}


def constraint(tools: list[dict], choice, parallel: bool) -> StructuredOutput | None:
    """What `choice` requires of the output over `tools` (OpenAI's `{"type": "function", "function": ...}`
    definitions); None when the model is free (`auto`, `none`)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        return StructuredOutput(json=schemas[choice["function"]["name"]])
    if choice != "required":
        return None
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                       "required": ["name", "parameters"], "additionalProperties": False}
                      for name, schema in schemas.items()]}
    return StructuredOutput(json={"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})})


def described(tools: list[dict]) -> str:
    """A system message telling a model whose template ignores `tools` what it may call and how."""
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return ("You may call these functions. To call one, answer with only "
            '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.\n'
            + "\n".join(lines))


def parse(text: str, tools: list[dict], choice, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) read out of the generated `text` under `choice`; without `parallel`, only the
    first call the model made is kept."""
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, dict):
        return None, [ToolCall(choice["function"]["name"], text)]
    if choice == "required":
        return None, [ToolCall(c["name"], _dump(c["parameters"])) for c in _whole_items(text)]
    if choice == "none":
        return text, []
    content, calls = _parse_auto(text, names)
    return content, calls if parallel else calls[:1]


def _whole_items(text: str) -> list:
    """The items of the JSON array `text`, or of as much of it as was written: an array cut short (by
    max_tokens) keeps the items it completed. ValueError when not even its first item is whole."""
    decoder, items, at = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at == len(text) and not items:
            raise ValueError("the array was cut before its first call was whole")
        if at == len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if items:
                return items
            raise
        items.append(item)


def _parse_auto(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    blocks = _BLOCK.findall(text)
    if blocks:
        calls = [c for c in (_call(_load(b), names) for b in blocks) if c]
        if calls:
            content = _BLOCK.sub("", text).strip()
            return content or None, calls
    stripped = text.strip().removeprefix("[TOOL_CALLS]").strip()
    loaded = _load(stripped)
    items = loaded if isinstance(loaded, list) else [loaded]
    calls = [_call(item, names) for item in items]
    if items and all(calls):
        return None, calls
    return text, []


def _call(item, names: set[str]) -> ToolCall | None:
    """A call when `item` is `{"name": <a tool>, "arguments" | "parameters": {...}}`."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    return ToolCall(item["name"], arguments if isinstance(arguments, str) else _dump(arguments))


def _load(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False)
