"""`CodeGenerator`: code for a task in a language, or a better version of given code, from a chat model on
the engine; the code extracted from the answer, and Python checked by `ast` (a syntax error gets one more
try, the model shown the error)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from cann_llm.apps.chat_model import DoesNotFit, fitting_prompt
from cann_llm.apps.codegen.extract import extract_code
from cann_llm.runtime.engine.sampling import SamplingParams

GENERATE = ("You are an expert {language} programmer. Write {language} code for the task below. "
            "Answer with the code in one ```{language} block and nothing else.\n\nTask: {description}")
OPTIMIZE = ("You are an expert {language} programmer. Rewrite the {language} code below to be faster and "
            "clearer, keeping what it does. Answer with the code in one ```{language} block.\n\n"
            "```{language}\n{code}\n```")
PYTHON = ("python", "py", "python3")
RETRY = "That code does not parse: {error}. Answer again with corrected code in one ```{language} block."
# the messages of the shortest request: the model's context must hold them and an answer
SHORTEST = [{"role": "user", "content": GENERATE.format(language="c", description="x")}]


@dataclass(frozen=True)
class CodeResult:
    """The code, the model's whole last answer, whether the code parses (None: a language not checked here),
    the syntax error if not, and how many answers it took."""

    code: str
    answer: str
    valid: bool | None
    error: str | None
    attempts: int


class CodeGenerator:
    """Code from `engine` (an `LLMEngine` with a chat template); `max_new_tokens` per answer, greedy unless
    `temperature` says otherwise. A request whose prompt leaves less than `max_new_tokens` of the model's
    context raises `DoesNotFit`."""

    def __init__(self, engine, max_new_tokens: int = 512, temperature: float = 0.0):
        self.engine = engine
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)

    def generate_code(self, description: str, language: str = "python") -> CodeResult:
        """Code for the task `description` in `language`."""
        return self._ask(GENERATE.format(language=language, description=description), language)

    def optimize_code(self, code: str, language: str = "python") -> CodeResult:
        """A faster, clearer version of `code`."""
        return self._ask(OPTIMIZE.format(language=language, code=code.strip("\n")), language)

    def _ask(self, request: str, language: str) -> CodeResult:
        messages = [{"role": "user", "content": request}]
        answer, code, error = self._answer(messages, language)
        attempts = 1
        if error is not None:  # once more, shown what is wrong
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": RETRY.format(error=error, language=language)}]
            try:
                answer, code, error = self._answer(messages, language)
                attempts = 2
            except DoesNotFit:  # no room left to show the model its error: the first answer stands
                pass
        checked = language.lower() in PYTHON
        return CodeResult(code, answer, (error is None) if checked else None, error, attempts)

    def _answer(self, messages: list[dict], language: str) -> tuple[str, str, str | None]:
        prompt = fitting_prompt(self.engine, messages, self.params.max_new_tokens)
        answer = self.engine.submit(prompt, self.params).result()
        code = extract_code(answer, language)
        return answer, code, syntax_error(code, language)


def syntax_error(code: str, language: str) -> str | None:
    """Python's syntax error in `code` ("line N: message"), None when it parses or is another language."""
    if language.lower() not in PYTHON:
        return None
    try:
        ast.parse(code)
    except SyntaxError as error:
        return f"line {error.lineno}: {error.msg}"
    return None
