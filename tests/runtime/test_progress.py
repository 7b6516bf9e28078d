"""Progress away from a terminal: plain lines a CI log can read, never carriage returns."""

from __future__ import annotations

import io

import pytest

from cann_llm.runtime import progress as progress_module
from cann_llm.runtime.progress import Progress, progress

pytestmark = pytest.mark.unit


def test_a_log_gets_a_start_line_and_an_end_line_with_the_count():
    stream = io.StringIO()
    with Progress("calibration", total=3, unit="sample", stream=stream) as bar:
        for _ in range(3):
            bar.update()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "calibration: started, 3 samples"
    assert lines[-1].startswith("calibration: 3 samples in ") and lines[-1].endswith(" s")
    assert "\r" not in stream.getvalue()


def test_lines_while_running_are_throttled(monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_INTERVAL", 0.0)
    stream = io.StringIO()
    with Progress("eval-ppl", total=2, unit="window", stream=stream) as bar:
        bar.update(status="ppl 12.3")
        bar.update()
    assert stream.getvalue().splitlines()[1:3] == ["eval-ppl: 1/2 windows (ppl 12.3)", "eval-ppl: 2/2 windows"]


def test_disabled_progress_prints_nothing_but_still_counts():
    stream = io.StringIO()
    with Progress("bench", stream=stream, enabled=False) as bar:
        bar.update(5)
    assert stream.getvalue() == "" and bar.count == 5


def test_a_failure_prints_no_end_line(capsys):
    try:
        for item in progress([1, 2], "load"):
            raise RuntimeError(item)
    except RuntimeError:
        pass
    assert capsys.readouterr().err.splitlines() == ["load: started, 2 its"]
