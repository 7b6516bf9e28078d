"""ATC's dynamic-shape flags: `--dynamic_batch_size`, `--dynamic_dims` and the deprecated `--input_shape_range`,
checked with ATC's codes (shared/reference/ATC.md §1.4), and the gears they make.

A gear is one full shape per input named in `--input_shape`: its `-1` dims replaced by one profile's values
(the batch size for `--dynamic_batch_size`; the profile's values in order, across the inputs, for
`--dynamic_dims`). The compiled graph keeps those dims dynamic; the artifact records the gears and the
runtime runs each feed at the smallest gear that holds it (cann_llm/runtime/shape_contract.py).
"""

from __future__ import annotations

from cann_llm.runtime.errors import AtcError

MIN_PROFILES, MAX_PROFILES = 2, 100

Dim = int | tuple[int, int]  # a size, -1 for dynamic, or a (low, high) range written "low~high"


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """`"1,2,4,8"` → (1, 2, 4, 8); a value that is not a whole number is E10038."""
    return _profile("dynamic_batch_size", text, text)


def parse_dims(text: str) -> tuple[tuple[int, ...], ...]:
    """`"1,16;2,32"` → ((1, 16), (2, 32)), one profile per `;`."""
    return tuple(_profile("dynamic_dims", text, part) for part in text.split(";") if part.strip())


def _profile(flag: str, text: str, part: str) -> tuple[int, ...]:
    values = []
    for value in part.split(","):
        value = value.strip()
        if not value.lstrip("-").isdigit() or int(value) <= 0:
            raise AtcError("E10038", text, flag)
        values.append(int(value))
    return tuple(values)


def parse_shape_ranges(text: str) -> str:
    """`--input_shape_range="input_ids:[1~8,16];mask:[1~8,-1]"` in `--input_shape`'s grammar (brackets dropped)."""
    return ";".join(item.replace("[", "").replace("]", "") for item in text.split(";") if item.strip())


def gears(input_shape: dict[str, tuple[Dim, ...]], batch_sizes: tuple[int, ...],
          dims: tuple[tuple[int, ...], ...]) -> tuple[dict[str, tuple[int, ...]], ...]:
    """The checked gears of `--dynamic_batch_size` or `--dynamic_dims` (empty when neither is given)."""
    if batch_sizes and dims:
        raise AtcError("E10009")
    flag, profiles = ("dynamic_batch_size", tuple((b,) for b in batch_sizes)) if batch_sizes else ("dynamic_dims", dims)
    if not profiles:
        return ()
    text = ",".join(map(str, batch_sizes)) if batch_sizes else ";".join(",".join(map(str, p)) for p in dims)
    if len(profiles) < MIN_PROFILES:
        raise AtcError("E10035", flag, len(profiles), MIN_PROFILES)
    if len(profiles) > MAX_PROFILES:
        raise AtcError("E10036", flag, len(profiles), MAX_PROFILES)
    if len({len(p) for p in profiles}) > 1:
        raise AtcError("E10037", text, flag)
    seen = set()
    for profile in profiles:
        if profile in seen:
            raise AtcError("E10039", text, flag, ",".join(map(str, profile)))
        seen.add(profile)
    shape_text = ";".join(f"{name}:{','.join(f'{x[0]}~{x[1]}' if isinstance(x, tuple) else str(x) for x in d)}"
                          for name, d in input_shape.items())
    if any(isinstance(d, tuple) for dims_ in input_shape.values() for d in dims_):
        raise AtcError("E10040", shape_text, flag)
    free = [(name, axis) for name, shape in input_shape.items() for axis, d in enumerate(shape) if d == -1]
    if batch_sizes:
        if not free or any(axis != 0 for _, axis in free):
            code = "E10031" if not any(axis == 0 for _, axis in free) else "E10018"
            raise AtcError(code, shape_text or '""')
    elif len(free) != len(profiles[0]):
        raise AtcError("E10045", text, len(free), shape_text or '""')
    made = []
    for profile in profiles:
        values = iter(profile * len(free) if batch_sizes else profile)
        made.append({name: tuple(next(values) if d == -1 else d for d in shape) for name, shape in input_shape.items()})
    return tuple(made)
