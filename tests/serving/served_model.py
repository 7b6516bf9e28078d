"""The artifact every serving test serves: tiny Llama, paged, with a byte tokenizer and a chat template
(a fixture the test modules import: a conftest.py here would shadow tests/conftest.py's helpers)."""

from __future__ import annotations

import pytest
from generation_utils import compile_tiny_chat_model

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="session")
def om(tmp_path_factory):
    return compile_tiny_chat_model(tmp_path_factory, CHAT_TEMPLATE)
