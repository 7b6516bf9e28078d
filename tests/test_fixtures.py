"""cann_llm/models/fixtures.py: what `make test` makes before pytest is what the tests would make on first use, and
nothing the cache already holds is made again."""

from __future__ import annotations

import pytest

from cann_llm.models import fixtures
from cann_llm.models.fixtures import TINY_EXPORTS, missing_jobs
from cann_llm.models.tiny import tiny_onnx, tiny_onnx_path


@pytest.mark.parametrize("case", [TINY_EXPORTS[0], TINY_EXPORTS[-1]], ids=str)
def test_the_path_checked_before_making_is_the_one_the_tests_read(case):
    family, dynamo, with_past, attention = case
    assert tiny_onnx_path(family, dynamo=dynamo, with_past=with_past, attention=attention) == \
        tiny_onnx(family, dynamo=dynamo, with_past=with_past, attention=attention)


@pytest.mark.unit
def test_an_empty_cache_gets_every_export_the_longest_first(tmp_path, monkeypatch):
    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path))
    work = missing_jobs()
    assert [fixtures.label(job) for job in work[:2]] == ["Optimum's exports", "SmolLM2-135M-Instruct (dynamo, KV cache)"]
    tiny = [job[1:] for job in work[2:]]
    assert sorted(tiny) == sorted(TINY_EXPORTS)
    dynamo = [case[1] for case in tiny]
    assert dynamo == sorted(dynamo, reverse=True)  # every dynamo export (~6 s of a core) before TorchScript's


@pytest.mark.unit
def test_an_export_in_the_cache_is_not_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("CANN_LLM_CACHE", str(tmp_path))
    family, dynamo, with_past, attention = TINY_EXPORTS[3]
    made = tiny_onnx_path(family, dynamo=dynamo, with_past=with_past, attention=attention)
    made.parent.mkdir(parents=True)
    made.write_bytes(b"")
    assert (fixtures._tiny, family, dynamo, with_past, attention) not in missing_jobs()
    assert len(missing_jobs()) == len(TINY_EXPORTS) + 1
