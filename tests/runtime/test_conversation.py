"""Conversations within a token budget on the tiny chat model: compaction by the model's own summary or by
dropping turns, the budget held on every turn, and conversations kept by id."""

from __future__ import annotations

import pytest
from generation_utils import compile_tiny_chat_model

from cann_llm.runtime.conversation import Conversation, ConversationManager, ConversationSettings
from cann_llm.runtime.engine.engine import LLMEngine

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    om = compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE, "conversation")
    with LLMEngine(om, max_context_len=512, kv_cache_pages=32) as engine:
        yield engine


def test_summaries_are_the_models_own_and_the_budget_holds(engine):
    conversation = Conversation(engine, ConversationSettings(budget_tokens=400, summary_tokens=32), system="be brief")
    summaries = []
    for turn in range(40):
        prompt = conversation.prompt(f"question {turn}: what next?", 24)
        assert len(prompt) + 24 <= 400
        summaries += [c for c in conversation.compactions if c.summary is not None]
        conversation.reply(engine.generate(prompt, max_new_tokens=24, temperature=0))
    assert summaries and conversation.summary == summaries[-1].summary
    assert conversation.compacted >= len(summaries)
    for compacted in summaries:  # what the model writes, greedy, for the request it was given
        assert compacted.summary == engine.generate(compacted.summary_prompt, max_new_tokens=32, temperature=0).strip()
    assert conversation.turns[-2]["content"] == "question 39: what next?"  # the latest exchange is whole
    assert conversation.messages()[0]["content"].startswith("be brief\n\nSummary of the conversation so far: ")


def test_dropping_takes_out_the_earliest_exchanges(engine):
    conversation = Conversation(engine, ConversationSettings(budget_tokens=200, compaction="drop"))
    dropped = []
    for turn in range(12):
        prompt = conversation.prompt(f"q{turn}", 16)
        assert len(prompt) + 16 <= 200
        dropped += conversation.compactions
        conversation.reply(engine.generate(prompt, max_new_tokens=16, temperature=0))
    assert dropped and all(c.messages == 2 and c.summary is None for c in dropped)
    assert conversation.compacted == len(dropped)
    assert conversation.summary is None and conversation.turns[-2]["content"] == "q11"
    assert len(conversation.turns) == 2 * 12 - 2 * len(dropped)


def test_a_turn_too_long_for_the_budget_is_refused_and_not_kept(engine):
    conversation = Conversation(engine, ConversationSettings(budget_tokens=100))
    conversation.say("hi", max_new_tokens=8, temperature=0)
    with pytest.raises(ValueError, match="does not fit the context"):
        conversation.prompt("x" * 200, 8)
    assert [m["content"] for m in conversation.turns][0] == "hi" and len(conversation.turns) == 2


def test_conversations_are_kept_by_id_and_the_oldest_forgotten(engine):
    manager = ConversationManager(engine, max_conversations=2)
    first = manager.get("a", system="s")
    assert manager.get("a") is first and first.system == "s"
    manager.get("b")
    manager.get("a")  # used again: "b" is now the least recently used
    manager.get("c")
    assert len(manager) == 2 and manager.get("a") is first
    with pytest.raises(ValueError, match="compaction"):
        ConversationSettings(compaction="forget")
