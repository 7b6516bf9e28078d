"""README.md is the front door and docs/ the manual: the README stays short and free of issue numbers,
and every relative link in either points at a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 150

pytestmark = pytest.mark.unit

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def _prose(text: str) -> str:
    """The text outside fenced and indented code blocks and inline code, where links are links."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "|", "*")):
            continue
        lines.append(_CODE_SPAN.sub("", line))
    return "\n".join(lines)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lowercased, punctuation dropped, spaces to hyphens,
    a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    """Link targets in `path` that are not URLs or mail addresses."""
    return [target for target in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def test_the_readme_is_at_most_150_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_the_readme_names_no_issue_numbers():
    text = README.read_text(encoding="utf-8")
    hits = re.findall(r"(?<![\w&])#\d+\b|\bissues? \d+", text, flags=re.IGNORECASE)
    assert not hits, hits


def test_the_docs_exist_and_link_somewhere():
    names = {path.name for path in PAGES}
    for page in ("atc.md", "artifact.md", "runtime.md", "serving.md", "quantization.md", "performance.md",
                 "ops.md", "exporting.md"):
        assert page in names
    assert any(relative_links(README))


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, broken


def test_the_anchor_rule_is_githubs():
    sample = ROOT / "docs" / "performance.md"
    found = anchors(sample)
    assert "quantization-on-smollm2" in found
    assert "contiguous-artifact-against-onnxruntime" in found
