"""The customer-service app: retrieval from the sample knowledge base and from a one-document one, the
hand-over when no document covers the question, each conversation's memory, the service and its page over
HTTP on 127.0.0.1 with a tiny model and its refusals (too large, blank, too long for the model), and the
command's refusals of a user's mistakes: one coded message, never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from app_process import app_process, assert_refused, run_app
from generation_utils import compile_tiny_chat_model

from cann_llm.apps.customer_service import CustomerServiceBot, KnowledgeBase
from cann_llm.apps.customer_service.bot import ESCALATION
from cann_llm.runtime.engine.engine import LLMEngine

KNOWLEDGE = Path(__file__).resolve().parents[2] / "cann_llm" / "apps" / "customer_service" / "knowledge"
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
    [best, *_] = KnowledgeBase(KNOWLEDGE).search(question)
    assert best.document.name == document and best.coverage >= 0.5


@pytest.fixture(scope="module")
def one_document(tmp_path_factory):
    """A knowledge base of the sample's shipping page alone, where BM25's scores are all small: a word in
    every document weighs almost nothing."""
    folder = tmp_path_factory.mktemp("one-document")
    shutil.copy(KNOWLEDGE / "shipping.md", folder)
    return KnowledgeBase(folder)


OFF_TOPIC = ["What is the weather on Mars?", "hello there", "Can you recommend a good pizza in Paris?",
             "Write me a poem about the sea"]


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


@pytest.mark.parametrize("question", OFF_TOPIC)
def test_a_question_no_document_covers_is_handed_over(question, om, one_document):
    """Whatever the number of documents: the sample's six (Paris has a store, and is a word of the
    question), or one."""
    with LLMEngine(om, max_context_len=2048, kv_cache_pages=64) as engine:
        for knowledge in (KnowledgeBase(KNOWLEDGE), one_document):
            assert CustomerServiceBot(engine, knowledge, max_new_tokens=8).answer("c", question).escalated


@pytest.mark.parametrize("question", ["How long does shipping take?", "Do you ship to Canada?",
                                      "How much does express shipping cost?"])
def test_a_one_document_knowledge_base_answers_what_it_covers(question, om, one_document):
    """And hands over what it does not (payment is another page of the sample)."""
    with LLMEngine(om, max_context_len=2048, kv_cache_pages=64) as engine:
        bot = CustomerServiceBot(engine, one_document, max_new_tokens=8)
        reply = bot.answer("c", question)
        assert not reply.escalated and reply.sources == ["shipping"]
        assert bot.answer("c", "Can I pay with PayPal?").escalated


def test_the_service_and_its_page_over_http(om):
    with app_process("cann_llm.apps.customer_service", "--model", str(om), "--max_new_tokens", "8") as url:
        page = httpx.get(url, timeout=30)
        assert page.status_code == 200 and 'id="ask"' in page.text and 'fetch("/chat"' in page.text
        reply = httpx.post(f"{url}/chat", json={"conversation_id": "web", "message": "Do you ship to Canada?"},
                           timeout=120).json()
        assert set(reply) == {"text", "sources", "escalated"} and reply["sources"][0] == "shipping"
        assert httpx.post(f"{url}/chat", json={"conversation_id": "web", "message": ""}, timeout=30).status_code == 422


def test_the_service_refuses_what_it_cannot_answer_with_the_reason(om):
    """The tiny model's byte tokenizer makes each emoji four tokens: 3,900 of them are past its 4,096."""
    with app_process("cann_llm.apps.customer_service", "--model", str(om), "--max_new_tokens", "8") as url:
        chat = f"{url}/chat"
        refused = httpx.post(chat, json={"conversation_id": "a", "message": "How much does shipping cost? " + "🚚" * 3900},
                             timeout=120)
        assert refused.status_code == 422 and "does not fit the context" in refused.json()["detail"]
        reply = httpx.post(chat, json={"conversation_id": "a", "message": "Do you ship to Canada?"}, timeout=120)
        assert reply.status_code == 200 and reply.json()["sources"][0] == "shipping"  # the refused turn left no trace
        blank = httpx.post(chat, json={"conversation_id": "a", "message": "   "}, timeout=30)
        assert blank.status_code == 422 and blank.json()["detail"][0]["loc"] == ["body", "message"]
        too_long = httpx.post(chat, json={"conversation_id": "a", "message": "x" * 500_000}, timeout=30)
        assert too_long.status_code == 422 and len(too_long.content) < 1000  # the input is not echoed back
        too_large = httpx.post(chat, json={"conversation_id": "a", "message": "x" * 2_000_000}, timeout=30)
        assert too_large.status_code == 413 and "--max-body-bytes" in too_large.json()["error"]["message"]


@pytest.fixture(scope="module")
def om_without_template(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, "", "support-no-template")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Knowledge bases the bot cannot use: empty, a PDF alone, a text file that is not UTF-8."""
    root = tmp_path_factory.mktemp("knowledge")
    (root / "empty").mkdir()
    (root / "pdf").mkdir()
    (root / "pdf" / "manual.pdf").write_bytes(b"%PDF-1.4\n")
    (root / "latin1").mkdir()
    (root / "latin1" / "returns.txt").write_bytes("Retours acceptés sous 30 jours".encode("latin-1"))
    return root


@pytest.mark.parametrize("argv,said", [
    (["--knowledge", "{folders}/empty"], ["E10001", "--knowledge", "holds no .md or .txt files"]),
    (["--knowledge", "{folders}/pdf"], ["E10001", "--knowledge", "holds no .md or .txt files"]),
    (["--knowledge", "{folders}/latin1"], ["E13001", "returns.txt", "not UTF-8"]),
    (["--model", "{no_template}"], ["E10055", "compiled without one"]),
    (["--port", "99999"], ["Value '99999' for parameter --port", "99999 is not in the range 0<=x<=65535"]),
    (["--max_new_tokens", "0"], ["0 is not in the range x>=1"]),
    (["--max_new_tokens", "5000"], ["E10001", "--max_new_tokens", "context holds 4096"]),
    (["--threshold", "2"], ["2.0 is not in the range 0<=x<=1"]),
])
def test_the_command_refuses_a_users_mistake_with_one_coded_message(argv, said, om, om_without_template, folders):
    paths = {"folders": folders, "no_template": om_without_template}
    done = run_app("cann_llm.apps.customer_service", "--model", str(om), *[arg.format(**paths) for arg in argv])
    assert_refused(done, *said)
    assert "customer service on" not in done.stderr


def test_the_page_in_a_real_browser(om):
    """Headless Chromium (Debian's, driven by Playwright): a question typed and sent, the answer shown with
    its source; a question no document covers shown as handed over."""
    from playwright.sync_api import sync_playwright

    with app_process("cann_llm.apps.customer_service", "--model", str(om), "--max_new_tokens", "8") as url:
        with sync_playwright() as playwright:
            # flags for a closed network: no background connections, no first-run work
            browser = playwright.chromium.launch(executable_path=BROWSER, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"])
            try:
                page = browser.new_page()
                page.goto(url)
                page.fill("#message", "How long does shipping take?")
                page.click("#send")
                answer = page.locator(".agent").first
                answer.wait_for(timeout=60_000)
                assert answer.locator(".meta").inner_text() == "from: shipping"
                assert page.locator(".customer span").first.inner_text() == "How long does shipping take?"
                page.fill("#message", "What is the weather on Mars?")
                page.press("#message", "Enter")
                handed = page.locator(".escalated")
                handed.wait_for(timeout=60_000)
                assert handed.locator(".meta").inner_text() == "handed to a colleague"
                assert page.locator(".agent").count() == 2
            finally:
                browser.close()
