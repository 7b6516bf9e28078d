"""The code in a model's answer, whatever its shape: fenced blocks (``` or ~~~, with or without a language,
closed or cut off at the end, indented inside a list item), several blocks (those in the asked language,
joined), code indented by four spaces under prose, or an answer that is code with a line of prose before or
after it."""

from __future__ import annotations

import re

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)\n"
                    r"(?P<body>.*?)(?:^(?P=indent)(?P=fence)[ \t]*$|\Z)", re.DOTALL | re.MULTILINE)
_ALIASES = {"py": "python", "python3": "python", "js": "javascript", "node": "javascript", "ts": "typescript",
            "sh": "bash", "shell": "bash", "c++": "cpp", "golang": "go", "rs": "rust"}
# the starts of lines that are code in the languages asked for most, for answers without fences
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import|return\b|raise\b|yield\b|pass\b|assert |if |for |"
                        r"while |elif |else:|try:|except|finally:|with |async |await |@|#include|int |void |public |"
                        r"private |function |const |let |var |fn |func |package |SELECT |#!|[\w.\[\]]+\s*=|[})\]];?\s*$|"
                        r"print\(|console\.)")


def extract_code(text: str, language: str | None = None) -> str:
    """The code in `text` (a model's answer), as the blocks of `language` when it is given and present."""
    text = text.replace("\r\n", "\n")  # a Windows line end would hide a closing fence from the pattern
    blocks = [(m["info"].strip().split()[0].lower() if m["info"].strip() else "", _dedent(m["body"], len(m["indent"])))
              for m in _FENCE.finditer(text)]
    if blocks:
        wanted = _canonical(language)
        chosen = [body for info, body in blocks if wanted and _canonical(info) == wanted] or \
                 [body for info, body in blocks if not info] or [body for _, body in blocks]
        return "\n\n".join(body.strip("\n") for body in chosen).rstrip() + "\n"
    indented = re.findall(r"(?:^(?: {4}|\t).*\n?)+", text, re.MULTILINE)
    prose = [line for line in text.splitlines() if line.strip() and not _CODE_LINE.match(line)]
    flush_code = any(_CODE_LINE.match(line) and not line.startswith((" ", "\t")) for line in text.splitlines())
    if indented and prose and not flush_code:  # Markdown's indented code block under prose
        block = max(indented, key=len)
        return "\n".join(line[4:] if line.startswith("    ") else line[1:] for line in block.rstrip("\n").splitlines()) + "\n"
    lines = text.strip("\n").splitlines()
    # prose before or after the code: the lines from the first that reads as code to the last, and the
    # indented lines after it, which continue its block whatever they start with
    code = [i for i, line in enumerate(lines) if _CODE_LINE.match(line)]
    if not code:
        return text.strip() + "\n" if text.strip() else ""
    end = code[-1]
    for i in range(end + 1, len(lines)):
        if lines[i].startswith((" ", "\t")) and lines[i].strip():
            end = i
        elif lines[i].strip():
            break
    return "\n".join(lines[code[0]:end + 1]).rstrip() + "\n"


def _dedent(body: str, width: int) -> str:
    """`body` with up to `width` leading blanks taken from each line: a fence indented inside a list item
    indents its code by as much, which is not the code's own."""
    lines = body.splitlines(keepends=True)
    return "".join(line[min(width, len(line) - len(line.lstrip(" \t"))):] for line in lines)


def _canonical(language: str | None) -> str:
    language = (language or "").strip().lower()
    return _ALIASES.get(language, language)
