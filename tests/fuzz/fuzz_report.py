"""How the CI fuzz tier reports what it found: the failing cases grouped by class."""

from __future__ import annotations


def describe(failures: list[tuple[str, dict, dict]]) -> str:
    """Failures grouped by class, with the mutation of the first case of each."""
    by_class: dict[str, list] = {}
    for name, case, outcome in failures:
        by_class.setdefault(name, []).append((case, outcome))
    lines = [f"{len(failures)} failing cases in {len(by_class)} classes:"]
    for name, cases in sorted(by_class.items(), key=lambda item: -len(item[1])):
        case, outcome = cases[0]
        lines.append(f"  {len(cases)} × {name}: {outcome.get('message', '')[:160]!r}")
        lines.append(f"      mutation: {' | '.join(case['log'])[:300]}")
    return "\n".join(lines)
