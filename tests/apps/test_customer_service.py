"""The customer-service app: retrieval from the sample knowledge base, the hand-over when nothing matches,
each conversation's memory, and the service and its page over HTTP on 127.0.0.1 with a tiny model."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from app_process import app_process
from generation_utils import compile_tiny_chat_model

from apps.customer_service import CustomerServiceBot, KnowledgeBase
from apps.customer_service.bot import ESCALATION
from runtime.engine.engine import LLMEngine

KNOWLEDGE = Path(__file__).resolve().parents[2] / "apps" / "customer_service" / "knowledge"
BROWSER = "/usr/bin/chromium"  # Debian's package, which `make test` installs
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.mark.parametrize("question,document", [
    ("How long do I have to return an item?", "returns"),
    ("When will I get my refund?", "returns"),
    ("How much does express shipping cost?", "shipping"),
    ("Do you ship to Canada?", "shipping"),
    ("My headphones broke after a year, is that covered?", "warranty"),
    ("Can I pay with PayPal?", "payment"),
    ("Can I pay in installments?", "payment"),
    ("I forgot my password", "account"),
    ("What time does the Paris store open?", "stores"),
    ("Can I pick up my order in a store?", "stores"),
])
def test_retrieval_puts_the_right_document_first(question, document):
    [(best, score), *_] = KnowledgeBase(KNOWLEDGE).search(question)
    assert best.name == document and score >= 0.5


@pytest.fixture(scope="module")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE, "support")


def test_answers_draw_on_documents_remember_the_conversation_and_hand_over_the_rest(om):
    with LLMEngine(om, max_context_len=2048, kv_cache_pages=64) as engine:
        bot = CustomerServiceBot(engine, KnowledgeBase(KNOWLEDGE), max_new_tokens=8)
        first = bot.answer("c1", "Can I pay with PayPal?")
        assert not first.escalated and first.sources[0] == "payment"
        second = bot.answer("c1", "And how long do refunds take?")
        conversation = bot.conversations.get("c1")
        assert [t["content"] for t in conversation.turns[::2]] == ["Can I pay with PayPal?", "And how long do refunds take?"]
        assert second.sources[0] == "returns" and "30 days of delivery" in conversation.system
        away = bot.answer("c1", "What is the weather on Mars?")
        assert away == type(away)(ESCALATION, [], True) and len(conversation.turns) == 6
        assert bot.answer("c2", "hello there").escalated and len(bot.conversations.get("c2").turns) == 2


def test_the_service_and_its_page_over_http(om):
    with app_process("apps.customer_service", "--model", str(om), "--max_new_tokens", "8") as url:
        page = httpx.get(url, timeout=30)
        assert page.status_code == 200 and 'id="ask"' in page.text and 'fetch("/chat"' in page.text
        reply = httpx.post(f"{url}/chat", json={"conversation_id": "web", "message": "Do you ship to Canada?"},
                           timeout=120).json()
        assert set(reply) == {"text", "sources", "escalated"} and reply["sources"][0] == "shipping"
        assert httpx.post(f"{url}/chat", json={"conversation_id": "web", "message": ""}, timeout=30).status_code == 422


def test_the_page_in_a_real_browser(om):
    """Headless Chromium (Debian's, driven by Playwright): a question typed and sent, the answer shown with
    its source; a question no document covers shown as handed over."""
    from playwright.sync_api import sync_playwright

    with app_process("apps.customer_service", "--model", str(om), "--max_new_tokens", "8") as url:
        with sync_playwright() as playwright:
            # flags for a closed network: no background connections, no first-run work
            browser = playwright.chromium.launch(executable_path=BROWSER, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"])
            try:
                page = browser.new_page()
                page.goto(url)
                page.fill("#message", "Do you ship to Canada?")
                page.click("#send")
                answer = page.locator(".agent").first
                answer.wait_for(timeout=60_000)
                assert answer.locator(".meta").inner_text() == "from: shipping"
                assert page.locator(".customer span").first.inner_text() == "Do you ship to Canada?"
                page.fill("#message", "What is the weather on Mars?")
                page.press("#message", "Enter")
                handed = page.locator(".escalated")
                handed.wait_for(timeout=60_000)
                assert handed.locator(".meta").inner_text() == "handed to a colleague"
                assert page.locator(".agent").count() == 2
            finally:
                browser.close()
