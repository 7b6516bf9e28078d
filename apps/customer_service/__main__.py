"""`python -m apps.customer_service --model x.om [--knowledge DIR] [--port 8080]`: the bot and its chat page."""

from __future__ import annotations

from pathlib import Path

import click

from cli.common_options import CONTEXT_SETTINGS

KNOWLEDGE = Path(__file__).with_name("knowledge")


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--model", "-m", required=True, help="a chat model's .om (with its tokenizer)")
@click.option("--knowledge", type=click.Path(exists=True, file_okay=False), default=str(KNOWLEDGE), show_default=True,
              help="a folder of .md and .txt files to answer from")
@click.option("--threshold", default=0.5, show_default=True,
              help="the BM25 score a document needs; below it for all, the question goes to a person")
@click.option("--max_new_tokens", default=200, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True)
def main(model: str, knowledge: str, threshold: float, max_new_tokens: int, host: str, port: int) -> None:
    """Serve the customer-service bot: its chat page at / and POST /chat."""
    import uvicorn

    from apps.customer_service.app import create_app
    from apps.customer_service.bot import CustomerServiceBot
    from apps.customer_service.knowledge import KnowledgeBase
    from cli.llm_commands import open_engine

    base = KnowledgeBase(knowledge)
    engine = open_engine(model)
    click.echo(f"customer service on http://{host}:{port} ({len(base.documents)} documents)", err=True)
    try:
        uvicorn.run(create_app(CustomerServiceBot(engine, base, threshold, max_new_tokens)), host=host, port=port,
                    log_level="warning")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
