"""Chat templates render byte for byte as transformers' `apply_chat_template` renders them: SmolLM2's own and
three templates in the styles of other families (Llama 3 with tools, Qwen 2.5 with tools, Gemma), shipped in
tests/serving/data/templates, which use what transformers' environment adds to jinja's: `{% break %}`, its
`tojson` (no HTML escaping), `strftime_now`, `raise_exception`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError

from cann_llm.runtime.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parent / "data" / "templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, <b>now</b> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PLAIN = [{"role": "system", "content": "Be brief & kind <always>."},
         {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "What's 2 < 3?"}]
CALLING = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"celsius": 18})}]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent))


def _ours(folder: Path, source: str) -> ChatTemplate:
    files = {name: (folder / name).read_text() for name in ("tokenizer_config.json", "tokenizer.json")}
    return ChatTemplate({**files, "chat_template.jinja": source})


CASES = [("smollm2", PLAIN, None), ("smollm2", PLAIN[1:], None),
         ("llama3_tools.jinja", PLAIN, None), ("llama3_tools.jinja", PLAIN, TOOLS), ("llama3_tools.jinja", CALLING, TOOLS),
         ("qwen25_tools.jinja", PLAIN, None), ("qwen25_tools.jinja", PLAIN, TOOLS), ("qwen25_tools.jinja", CALLING, TOOLS),
         ("gemma.jinja", PLAIN, None), ("gemma.jinja", PLAIN[1:], None)]


@pytest.mark.parametrize("template,messages,tools", CASES,
                         ids=[f"{t.split('.')[0]}-{i}" for i, (t, _, _) in enumerate(CASES)])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_as_transformers_renders(hf_tokenizer, smollm2_path, template, messages, tools, add_generation_prompt):
    folder = smollm2_path.parent
    source = (folder / "chat_template.jinja").read_text() if template == "smollm2" else (TEMPLATES / template).read_text()
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=source, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert _ours(folder, source).render(messages, add_generation_prompt, tools) == expected


def test_a_template_that_raises_says_why(smollm2_path):
    gemma = _ours(smollm2_path.parent, (TEMPLATES / "gemma.jinja").read_text())
    with pytest.raises(TemplateError, match="roles must alternate"):
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_role_beyond_openais_renders_only_where_the_template_names_it(smollm2_path):
    """Llama 3.1's template names `ipython` (a tool's output); SmolLM2's names no role beyond OpenAI's."""
    folder = smollm2_path.parent
    llama = _ours(folder, (TEMPLATES / "llama3_tools.jinja").read_text())
    assert "<|start_header_id|>ipython<|end_header_id|>" in llama.render([{"role": "ipython", "content": "18"}])
    with pytest.raises(ValueError, match="not 'ipython'"):
        _ours(folder, (folder / "chat_template.jinja").read_text()).render([{"role": "ipython", "content": "18"}])
