"""`CustomerServiceBot`: one answer per customer message, from the knowledge base's three best documents and
the conversation so far; a hand-over to a person when no document covers enough of the question."""

from __future__ import annotations

from dataclasses import dataclass

from cann_llm.apps.chat_model import DoesNotFit
from cann_llm.apps.customer_service.knowledge import KnowledgeBase
from cann_llm.runtime.conversation import ConversationManager, ConversationSettings
from cann_llm.runtime.engine.sampling import SamplingParams

SYSTEM = ("You are a friendly and professional customer-service agent. Answer the customer's question using "
          "only the reference documents below. If they do not contain the answer, say you will pass the "
          "question to a colleague. Keep answers short.\n\nReference documents:\n{documents}")
ESCALATION = ("I'm sorry, I don't have information about that. I'm passing your question to one of my human "
              "colleagues, who will get back to you shortly.")


@dataclass(frozen=True)
class Reply:
    """The answer, the documents it drew on, and whether the question was handed to a person."""

    text: str
    sources: list[str]
    escalated: bool


class CustomerServiceBot:
    """Answers with `engine` from `knowledge`; `threshold` the share of a question's words (0 to 1) a document
    must contain to be used (`Match.coverage`)."""

    def __init__(self, engine, knowledge: KnowledgeBase, threshold: float = 0.5, max_new_tokens: int = 200,
                 top_k: int = 3):
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold is a share of the question's words, from 0 to 1, not {threshold}")
        self.engine, self.knowledge, self.threshold, self.top_k = engine, knowledge, threshold, top_k
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
        self.conversations = ConversationManager(engine, ConversationSettings())

    def answer(self, conversation_id: str, message: str) -> Reply:
        """The reply to `message` in the conversation `conversation_id` (one turn of it at a time); DoesNotFit
        when the turn, with its documents and room for the reply, is longer than the model's context."""
        found = [match.document for match in self.knowledge.search(message, self.top_k)
                 if match.coverage >= self.threshold]
        with self.conversations.lock(conversation_id):
            conversation = self.conversations.get(conversation_id)
            if not found:
                conversation.turns += [{"role": "user", "content": message}, {"role": "assistant", "content": ESCALATION}]
                return Reply(ESCALATION, [], True)
            conversation.system = SYSTEM.format(documents="\n\n".join(doc.text.strip() for doc in found))
            try:
                text = conversation.say(message, max_new_tokens=self.params.max_new_tokens, temperature=0)
            except ValueError as error:  # the conversation's refusal: the turn cannot fit even alone
                raise DoesNotFit(str(error)) from None
        return Reply(text.strip(), [doc.name for doc in found], False)


def shortest_turn(knowledge: KnowledgeBase) -> list[dict]:
    """The messages of the shortest turn the bot can ask the model: its shortest document and a one-character
    question."""
    document = min(knowledge.documents, key=lambda doc: len(doc.text.strip()))
    return [{"role": "system", "content": SYSTEM.format(documents=document.text.strip())},
            {"role": "user", "content": "?"}]
