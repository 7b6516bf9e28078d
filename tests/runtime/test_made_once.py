"""made_once: processes asking for one file together get it made once, and whoever waited reads it whole."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from cann_llm.runtime.made_once import made_once

pytestmark = pytest.mark.unit


def _ask(target: str, makers: str, start) -> None:
    def make() -> None:
        with open(makers, "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # long enough that every other process asks while this one is making
        partial = Path(target + ".partial")
        partial.write_text("made")
        os.replace(partial, target)

    start.wait()
    path = made_once(Path(target), make)
    assert path.read_text() == "made"


def test_four_processes_asking_together_make_it_once(tmp_path):
    target, makers = tmp_path / "out" / "file", tmp_path / "makers"
    context = multiprocessing.get_context("fork")
    start = context.Barrier(4)
    processes = [context.Process(target=_ask, args=(str(target), str(makers), start)) for _ in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    assert [process.exitcode for process in processes] == [0, 0, 0, 0]
    assert len(makers.read_text().split()) == 1
    assert target.read_text() == "made"


def test_a_failed_make_leaves_nothing_and_the_next_caller_makes_it(tmp_path):
    target = tmp_path / "file"

    def fail() -> None:
        raise RuntimeError("no compiler")

    with pytest.raises(RuntimeError, match="no compiler"):
        made_once(target, fail)
    assert not target.exists()
    # a lock the failure kept would make the next caller wait for ever: it gets a thread and 30 s
    made: list[str] = []
    caller = threading.Thread(target=lambda: made.append(made_once(target, lambda: target.write_text("made")).read_text()))
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "the failed make kept the lock"
    assert made == ["made"]
