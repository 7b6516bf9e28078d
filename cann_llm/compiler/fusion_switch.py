"""`--fusion_switch_file` in both of ATC's forms.

Text, one rule per line:        RmsNormFusionPass:off
JSON:  {"Switch": {"GraphFusion": {"ALL": "off", "RmsNormFusionPass": "on"}, "UBFusion": {...}}}
Both give {pass name: on?}, with the key "ALL" standing for every switchable pass.
"""

from __future__ import annotations

import json

from cann_llm.runtime.errors import AtcError, invalid_value

_STATES = {"on": True, "off": False}


def parse_fusion_switch_file(path: str) -> dict[str, bool]:
    """Read a switch file; later entries override earlier ones, a named pass overrides ALL."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if text.lstrip().startswith("{"):
        return _parse_json(path, text)
    switches: dict[str, bool] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, state = (part.strip() for part in line.partition(":"))
        if not sep or state.lower() not in _STATES or not name:
            raise invalid_value(line, "fusion_switch_file", f"Line {number} must be '<PassName>:on' or '<PassName>:off'.")
        switches[name] = _STATES[state.lower()]
    return switches


def _parse_json(path: str, text: str) -> dict[str, bool]:
    try:
        document = json.loads(text)
        groups = document["Switch"]
        if not isinstance(groups, dict):
            raise TypeError("'Switch' must be an object")
    except (ValueError, KeyError, TypeError) as error:
        raise AtcError("E10032", path, f"expected {{\"Switch\": {{\"GraphFusion\": {{...}}}}}} ({error})") from None
    switches: dict[str, bool] = {}
    for group in ("GraphFusion", "UBFusion"):
        for name, state in (groups.get(group) or {}).items():
            if str(state).lower() not in _STATES:
                raise AtcError("E10032", path, f"the state of {name} must be \"on\" or \"off\", not {state!r}")
            switches[name] = _STATES[str(state).lower()]
    return switches


def parse_switch_list(text: str) -> dict[str, bool]:
    """`--optimization_switch="Pass1:on;Pass2:off"`: the same switches, given on the command line."""
    switches: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, state = (part.strip() for part in item.partition(":"))
        if not sep or state.lower() not in _STATES or not name:
            raise invalid_value(item, "optimization_switch", "Each entry must be '<PassName>:on' or '<PassName>:off'.")
        switches[name] = _STATES[state.lower()]
    return switches


def read_mixlist(path: str) -> tuple[str, ...]:
    """`--modify_mixlist`'s JSON: the op types its "black-list" adds, whose weights keep their dtype in a mixed
    mode. Its other lists move ops between precisions of arithmetic, which is float32 for every op here."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
        added = (document.get("black-list") or {}).get("to-add") or []
        if not isinstance(added, list) or not all(isinstance(op, str) and op for op in added):
            raise TypeError('"black-list": {"to-add": [...]} must list op type names')
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise AtcError("E10032", path, str(error)) from None
    return tuple(added)


def is_enabled(switches: dict[str, bool], name: str) -> bool:
    """Whether pass `name` runs: its own switch, else ALL, else on."""
    return switches.get(name, switches.get("ALL", True))
