"""Conversations that never overflow the context.

`Conversation` keeps one conversation's messages within a token budget (prompt and reply). When the next
turn would not fit, its earliest turns are compacted: summarised by the model itself into a summary carried
in the system message (the default; a later compaction summarises the summary with the next turns), or
dropped. The latest exchanges are kept as they are while anything older is left to compact.
`ConversationManager` keeps conversations by id, the least recently used forgotten past a bound, for a
server or an application.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from cann_llm.runtime.engine.checked import integer, text
from cann_llm.runtime.engine.engine import raise_if_closed_under
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.setting_error import SettingError

COMPACTIONS = ("summarize", "drop")
SUMMARY_REQUEST = ("Summarise the conversation below in a few sentences, so that the assistant can continue it. "
                   "Keep names, numbers, facts and decisions; leave out greetings.\n\n{transcript}")
SUMMARY_HEADING = "Summary of the conversation so far: "


@dataclass(frozen=True)
class ConversationSettings:
    """How a conversation stays within its budget."""

    budget_tokens: int | None = None  # prompt + reply; None: the engine's max_context_len
    compaction: str = "summarize"     # or "drop"
    keep_recent: int = 1              # exchanges kept whole before the new turn, while older ones remain
    summary_tokens: int = 128         # the longest summary the model may write (at most a quarter of the context)

    def __post_init__(self) -> None:
        if text("compaction", self.compaction) not in COMPACTIONS:
            raise SettingError("compaction", f"compaction must be one of {', '.join(COMPACTIONS)}, not {self.compaction!r}")
        for name, low in (("budget_tokens", 2), ("keep_recent", 0), ("summary_tokens", 1)):
            value = getattr(self, name)
            if value is not None or name != "budget_tokens":
                object.__setattr__(self, name, integer(name, value))
                if value < low:
                    raise SettingError(name, f"{name} must be at least {low}, not {value}")


@dataclass(frozen=True)
class Compaction:
    """One compaction: how many messages it took out, and (when summarised) the prompt the model was given
    and the summary it wrote."""

    messages: int
    summary_prompt: list[int] | None = None
    summary: str | None = None


@dataclass
class Conversation:
    """One conversation with `engine`: `say(text, **sampling)` answers a user turn; or `prompt(text,
    reply_tokens)` for the turn's prompt (token ids) and `reply(text)` with the answer, for a caller that
    streams it."""

    engine: object
    settings: ConversationSettings = field(default_factory=ConversationSettings)
    system: str | None = None
    summary: str | None = None
    turns: list[dict] = field(default_factory=list)  # user and assistant messages after the system message
    # the latest turn's compactions only: a summary's request is as long as the context, and a server keeps
    # a thousand conversations for as long as they last
    compactions: list[Compaction] = field(default_factory=list)
    compacted: int = 0  # compactions over the whole conversation

    @property
    def budget(self) -> int:
        """Tokens of prompt and reply a turn may take."""
        limit = self.engine.max_context_len
        return min(self.settings.budget_tokens or limit, limit)

    def messages(self) -> list[dict]:
        """The messages as the chat template gets them: the system message (with the summary), then the turns."""
        system = self.system
        if self.summary is not None:
            system = (f"{system}\n\n" if system else "") + SUMMARY_HEADING + self.summary
        return ([{"role": "system", "content": system}] if system else []) + self.turns

    def say(self, text: str, **sampling) -> str:
        """The model's answer to the user's `text` (sampling settings as `SamplingParams` takes them)."""
        params = SamplingParams(**sampling)
        prompt = self.prompt(text, params.max_new_tokens)
        request = None
        try:
            request = self.engine.submit(prompt, params)
            answer = request.result()
            raise_if_closed_under([request])
        except BaseException:  # refused, failed or interrupted: a turn without an answer is not kept
            if request is not None:
                request.cancel()
            self.turns.pop()
            raise
        self.reply(answer)
        return answer

    def prompt(self, text: str, reply_tokens: int, deadline: float | None = None) -> list[int]:
        """The prompt for the user's `text` with `reply_tokens` left for the answer within the budget,
        compacting earlier turns as needed (`compactions` then lists them); ValueError when the turn cannot
        fit even alone, TimeoutError when a summary is not written by `deadline` (a `time.monotonic()`
        instant; the compactions done before it are kept)."""
        self.compactions = []
        if reply_tokens >= self.budget:
            raise SettingError("max_new_tokens", f"a reply of {reply_tokens} tokens leaves no room for the prompt "
                                                 f"within the conversation's budget of {self.budget} tokens")
        self.turns.append({"role": "user", "content": text})
        try:
            return self._fit(self.budget - reply_tokens, reply_tokens, deadline)
        except BaseException:  # refused, failed or interrupted while compacting: the turn is not kept
            self.turns.pop()
            raise

    def reply(self, text: str) -> None:
        """Record the assistant's answer to the last turn."""
        self.turns.append({"role": "assistant", "content": text})

    def _fit(self, limit: int, reply_tokens: int, deadline: float | None) -> list[int]:
        alone = None
        while True:
            ids = self.engine.chat_prompt(self.messages())
            if len(ids) <= limit:
                return ids
            if alone is None:  # nothing is compacted for a turn that could not fit even by itself
                system = [{"role": "system", "content": self.system}] if self.system else []
                alone = len(self.engine.chat_prompt(system + self.turns[-1:]))
                if alone > limit:
                    raise SettingError("prompt", f"the turn does not fit the context: {alone} prompt tokens and {reply_tokens} "
                                     f"for the reply, {self.budget} allowed")
            older = len(self.turns) - 1 - 2 * self.settings.keep_recent
            count = older if older > 0 else len(self.turns) - 1  # the recent ones too, when nothing else is left
            if count > 0:
                self._compact(count, deadline)
            elif self.summary is not None:  # the summary alone is too long for this turn: it goes
                self.summary = None
                self._record(Compaction(0))
            else:
                raise SettingError("prompt", f"the turn does not fit the context: {len(ids)} prompt tokens and {reply_tokens} "
                                 f"for the reply, {self.budget} allowed")

    def _compact(self, count: int, deadline: float | None) -> None:
        """Take out the earliest exchange (drop), or the older half of the `count` compactable messages
        (summarize, at least one exchange)."""
        if self.settings.compaction == "drop":
            taken = min(2, count)
            del self.turns[:taken]
            self._record(Compaction(taken))
            return
        half = count // 2
        taken = min(count, max(2, half - half % 2))  # whole exchanges
        prompt = self._summary_prompt(self.turns[:taken])
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the conversation's deadline passed before its earlier turns were summarised")
        request = self.engine.submit(prompt, SamplingParams(max_new_tokens=self._summary_tokens, temperature=0))
        if deadline is not None:  # ended by the engine itself, however long it waits for a place in the batch
            request.expire_at(deadline)
        try:
            summary = request.result().strip()
        except BaseException:  # interrupted: the summary is not wanted any more
            request.cancel()
            raise
        if request.finish_reason == "timeout":  # a summary cut short is not kept
            raise TimeoutError("the conversation's deadline passed while its earlier turns were being summarised")
        raise_if_closed_under([request])
        del self.turns[:taken]
        self.summary = summary
        self._record(Compaction(taken, prompt, summary))

    def _record(self, compaction: Compaction) -> None:
        self.compactions.append(compaction)
        self.compacted += 1

    @property
    def _summary_tokens(self) -> int:
        return min(self.settings.summary_tokens, self.engine.max_context_len // 4)

    def _summary_prompt(self, messages: list[dict]) -> list[int]:
        """The request for a summary of the earlier summary and `messages`, its transcript cut from the
        front where it would not leave room for the summary."""
        lines = [f"{SUMMARY_HEADING}{self.summary}"] if self.summary else []
        lines += [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        transcript = "\n".join(lines)
        room = self.engine.max_context_len - self._summary_tokens
        while True:
            asked = self.engine.chat_prompt([{"role": "user", "content": SUMMARY_REQUEST.format(transcript=transcript)}])
            if len(asked) <= room:
                return asked
            if not transcript:
                raise SettingError("compaction", f"the context ({self.engine.max_context_len} tokens) is too small "
                                                 f"to ask for a summary of {self._summary_tokens} tokens; compact by "
                                                 f"dropping turns instead")
            # a character is at least part of a token: cutting as many characters as there are tokens too many,
            # or an eighth, converges in a few rounds whatever the tokenizer
            transcript = transcript[max(len(asked) - room, len(transcript) // 8):]


class ConversationManager:
    """Conversations by id with one engine and one set of settings; past `max_conversations` the least
    recently used is forgotten. `lock(id)` serialises the turns of one conversation."""

    def __init__(self, engine, settings: ConversationSettings | None = None, max_conversations: int = 1024):
        if isinstance(max_conversations, bool) or not isinstance(max_conversations, int) or max_conversations < 1:
            raise ValueError(f"max_conversations must be a positive integer, not {max_conversations!r}")
        self.engine, self.settings, self.max_conversations = engine, settings or ConversationSettings(), max_conversations
        self._conversations: OrderedDict[str, tuple[Conversation, threading.Lock]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, conversation_id: str, system: str | None = None) -> Conversation:
        """The conversation of `conversation_id`, started (with `system`) if it is new."""
        return self._entry(conversation_id, system)[0]

    def lock(self, conversation_id: str) -> threading.Lock:
        """The lock a caller holds while it takes a turn of `conversation_id`."""
        return self._entry(conversation_id, None)[1]

    def forget(self, conversation_id: str) -> None:
        with self._lock:
            self._conversations.pop(conversation_id, None)

    def __len__(self) -> int:
        return len(self._conversations)

    def _entry(self, conversation_id: str, system: str | None) -> tuple[Conversation, threading.Lock]:
        with self._lock:
            entry = self._conversations.get(conversation_id)
            if entry is None:
                entry = (Conversation(self.engine, self.settings, system), threading.Lock())
                self._conversations[conversation_id] = entry
                while len(self._conversations) > self.max_conversations:
                    self._conversations.popitem(last=False)
            self._conversations.move_to_end(conversation_id)
            return entry
