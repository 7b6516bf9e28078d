"""Tool calls read out of generated text (cann_llm/runtime/serving/tools.py), in the spellings chat templates teach,
and the constraints a tool_choice puts on the output."""

from __future__ import annotations

import json

import pytest

from cann_llm.runtime.serving import tools

pytestmark = pytest.mark.unit
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('{"name": "get_time", "parameters": {"city": "Rome"}}', None, [("get_time", {"city": "Rome"})]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}]', None, [("get_weather", {"city": "Lima"})]),
    ('{"name": "not_a_tool", "arguments": {}}', '{"name": "not_a_tool", "arguments": {}}', []),
    ("Paris is sunny.", "Paris is sunny.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> broken', None, None),
])
def test_auto_reads_the_calls_a_model_wrote(text, content, calls):
    said, found = tools.parse(text, TOOLS, "auto")
    if calls is None:  # a malformed block is not a call: the text stays the content
        assert said == text and found == []
        return
    assert said == content and [(c.name, json.loads(c.arguments)) for c in found] == calls
    assert len({c.id for c in found}) == len(found)


def test_required_and_named_choices_constrain_and_parse():
    required = tools.constraint(TOOLS, "required", parallel=False)
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    assert "maxItems" not in tools.constraint(TOOLS, "required", parallel=True).json
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tools.constraint(TOOLS, named, True).json == {"type": "object"}
    assert tools.constraint(TOOLS, "auto", True) is None and tools.constraint(TOOLS, "none", True) is None
    _, calls = tools.parse('[{"name": "get_time", "parameters": {}}]', TOOLS, "required")
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert tools.parse('{"city": "Paris"}', TOOLS, named)[1][0].arguments == '{"city": "Paris"}'
    assert tools.parse("plain", TOOLS, "none") == ("plain", [])


def test_without_parallel_calls_only_the_first_is_kept():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert [c.name for c in tools.parse(text, TOOLS, "auto", parallel=True)[1]] == ["get_weather", "get_time"]
    assert [c.name for c in tools.parse(text, TOOLS, "auto", parallel=False)[1]] == ["get_weather"]


@pytest.mark.parametrize("text,names", [
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa', ["get_time"]),
    ('[{"name": "get_time", "parameters": {}},\n {"name": "get_weather", "parameters": {}}, ', ["get_time", "get_weather"]),
    ('[{"name": "get_time", "parameters": {}}', ["get_time"]),
])
def test_required_calls_cut_short_by_max_tokens_keep_the_calls_they_completed(text, names):
    assert [c.name for c in tools.parse(text, TOOLS, "required")[1]] == names


@pytest.mark.parametrize("text", ['[{"name": "get_ti', "[", "[ \n"])
def test_required_output_with_no_whole_call_is_refused_for_the_text_to_stand(text):
    with pytest.raises(ValueError):
        tools.parse(text, TOOLS, "required")
