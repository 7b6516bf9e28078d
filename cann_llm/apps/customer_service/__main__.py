"""`python -m cann_llm.apps.customer_service --model x.om [--knowledge DIR] [--port 8080]`: the bot and its chat page.
A user's mistake (a knowledge base without readable documents, a model that cannot chat, an answer longer
than the model's context) is one coded message and a non-zero exit status, before anything is served."""

from __future__ import annotations

from pathlib import Path

import click

from cann_llm.apps.command import HOST, MAX_BODY, max_new_tokens_option, open_chat_model, port_option, serve_on
from cann_llm.runtime.serving.lifecycle import listen
from cann_llm.cli.coded_errors import main_with_codes
from cann_llm.cli.common_options import CONTEXT_SETTINGS

KNOWLEDGE = Path(__file__).with_name("knowledge")


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--model", "-m", required=True, help="a chat model's .om (with its tokenizer)")
@click.option("--knowledge", type=click.Path(exists=True, file_okay=False), default=str(KNOWLEDGE), show_default=True,
              help="a folder of .md and .txt files to answer from")
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="the share of a question's words a document must contain to be used; with none, the question "
                   "goes to a person")
@max_new_tokens_option(200)
@HOST
@port_option(8080)
@MAX_BODY
def main(model: str, knowledge: str, threshold: float, max_new_tokens: int, host: str, port: int,
         max_body_bytes: int) -> None:
    """Serve the customer-service bot: its chat page at / and POST /chat."""
    from cann_llm.apps.customer_service.app import create_app
    from cann_llm.apps.customer_service.bot import CustomerServiceBot, shortest_turn
    from cann_llm.apps.customer_service.knowledge import KnowledgeBase

    base = KnowledgeBase(knowledge)  # before the model loads: a bad folder fails at once
    with listen(host, port) as listener:
        engine = open_chat_model(model, max_new_tokens, shortest_turn(base))
        try:
            bot = CustomerServiceBot(engine, base, threshold, max_new_tokens)
            serve_on(listener, create_app(bot, max_body_bytes),
                     f"customer service on {{url}} ({len(base.documents)} documents)")
        finally:
            engine.close()


if __name__ == "__main__":
    main_with_codes(main)
