"""`CustomerServiceBot`: one answer per customer message, from the knowledge base's three best documents and
the conversation so far; a hand-over to a person when no document scores above the threshold."""

from __future__ import annotations

from dataclasses import dataclass

from apps.customer_service.knowledge import KnowledgeBase
from runtime.conversation import ConversationManager, ConversationSettings
from runtime.engine.sampling import SamplingParams

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
    """Answers with `engine` from `knowledge`; `threshold` the BM25 score a document needs to be used."""

    def __init__(self, engine, knowledge: KnowledgeBase, threshold: float = 0.5, max_new_tokens: int = 200,
                 top_k: int = 3):
        self.engine, self.knowledge, self.threshold, self.top_k = engine, knowledge, threshold, top_k
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
        self.conversations = ConversationManager(engine, ConversationSettings())

    def answer(self, conversation_id: str, message: str) -> Reply:
        """The reply to `message` in the conversation `conversation_id` (one turn of it at a time)."""
        found = [(doc, score) for doc, score in self.knowledge.search(message, self.top_k) if score >= self.threshold]
        with self.conversations.lock(conversation_id):
            conversation = self.conversations.get(conversation_id)
            if not found:
                conversation.turns += [{"role": "user", "content": message}, {"role": "assistant", "content": ESCALATION}]
                return Reply(ESCALATION, [], True)
            conversation.system = SYSTEM.format(documents="\n\n".join(doc.text.strip() for doc, _ in found))
            text = conversation.say(message, max_new_tokens=self.params.max_new_tokens, temperature=0)
        return Reply(text.strip(), [doc.name for doc, _ in found], False)
