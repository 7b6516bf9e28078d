"""An intelligent customer-service bot on the engine: answers from a knowledge base (a folder of Markdown or
text files ranked by BM25, the top three given to the model), each conversation's memory kept by the
conversation manager, and a hand-over to a person when no document covers enough of the question."""

from cann_llm.apps.customer_service.bot import CustomerServiceBot, Reply
from cann_llm.apps.customer_service.knowledge import KnowledgeBase, Match

__all__ = ["CustomerServiceBot", "KnowledgeBase", "Match", "Reply"]
