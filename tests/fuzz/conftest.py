"""The fuzz tier's shared pieces: the bases (tiny exports and their artifacts) and one worker pool."""

from __future__ import annotations

import pytest
from fuzz_corpus import om_bases, onnx_bases
from fuzz_pool import Pool
from hypothesis import HealthCheck, Phase, settings

# CI runs the same cases every time (derandomized, no example database), and does not shrink: a failing case
# is reported with what its mutation did (its log), and the run goes on, so one run lists every class
settings.register_profile("fuzz-ci", derandomize=True, database=None, deadline=None, phases=(Phase.explicit, Phase.generate),
                          suppress_health_check=list(HealthCheck), print_blob=False)


@pytest.fixture(scope="session")
def fuzz_onnx_bases():
    return onnx_bases()


@pytest.fixture(scope="session")
def fuzz_om_bases(tmp_path_factory, fuzz_onnx_bases):
    return om_bases(tmp_path_factory.mktemp("fuzz-bases"), fuzz_onnx_bases)


@pytest.fixture(scope="session")
def fuzz_pool(tmp_path_factory):
    pool = Pool(tmp_path_factory.mktemp("fuzz-pool"), workers=1)
    yield pool
    pool.close()


def describe(failures: list[tuple[str, dict, dict]]) -> str:
    """Failures grouped by class, with the mutation of the first case of each."""
    by_class: dict[str, list] = {}
    for name, case, outcome in failures:
        by_class.setdefault(name, []).append((case, outcome))
    lines = [f"{len(failures)} failing cases in {len(by_class)} classes:"]
    for name, cases in sorted(by_class.items(), key=lambda item: -len(item[1])):
        case, outcome = cases[0]
        lines.append(f"  {len(cases)} × {name}: {outcome.get('message', '')[:160]!r}\n      mutation: {' | '.join(case['log'])[:300]}")
    return "\n".join(lines)
