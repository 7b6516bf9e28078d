"""The input shapes an artifact was compiled for, held at run time: `--input_shape`'s fixed dims and `low~high`
ranges, and the gears of `--dynamic_batch_size` / `--dynamic_dims` (cann_llm/compiler/dynamic_shapes.py).

A feed outside what was compiled is refused with E10001 naming the input and what it allows. With gears, a
feed runs at the smallest gear that holds it: its varied dims are padded with zeros up to the gear, and
every output dim that shares a padded input dim's symbol is cut back, so the caller sees the shapes it fed.
Padding is exact where the padded rows or positions cannot reach the real ones: other batch rows, and
positions after the real ones in a causal model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cann_llm.runtime.errors import AtcError


@dataclass(frozen=True)
class ShapeContract:
    """Per named input, each dim: an int (fixed when > 0, free when -1) or [low, high]; and the gears."""

    input_shape: dict[str, list]
    gears: tuple[dict[str, tuple[int, ...]], ...]
    symbols: dict[str, list]  # each input's dims as the signature names them (str for a symbolic dim)
    gear_kind: str | None = None  # "batch" (--dynamic_batch_size) or "dims" (--dynamic_dims)

    @classmethod
    def of(cls, metadata: dict) -> "ShapeContract | None":
        """The artifact's contract, or None when it was compiled without `--input_shape`."""
        section = metadata.get("shape_contract")
        if not section:
            return None
        symbols = {value["name"]: value["shape"] for value in metadata["signature"]["inputs"]}
        gears = tuple({name: tuple(shape) for name, shape in gear.items()} for gear in section.get("gears") or ())
        return cls(section["input_shape"], gears, symbols, section.get("gear_kind"))

    def fit(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """The feeds as they run (padded up to the smallest gear holding them), and {symbol: real size} for
        each padded dim, to cut the outputs back with `cut`. Raises E10001 for a feed outside the contract."""
        for name, dims in self.input_shape.items():
            if name in feeds:
                self._check_dims(name, np.shape(feeds[name]), dims)
        if not self.gears:
            return feeds, {}
        shapes = {name: np.shape(feeds[name]) for name in self.gears[0] if name in feeds}
        holding = [gear for gear in self.gears if all(len(shape) == len(gear[name]) and all(
            f <= g for f, g in zip(shape, gear[name])) for name, shape in shapes.items())]
        if not holding:
            fed = "; ".join(f"{name}:{','.join(map(str, shape))}" for name, shape in shapes.items())
            raise AtcError("E10001", fed, "input shape", f"it fits none of the gears the model was compiled for: "
                                                         f"{self._gear_text()}")
        gear = min(holding, key=lambda g: sum(int(np.prod(g[name])) for name in shapes))
        padded, real = dict(feeds), {}
        for name, shape in shapes.items():
            target = gear[name]
            if tuple(shape) == target:
                continue
            padded[name] = np.pad(feeds[name], [(0, t - f) for f, t in zip(shape, target)])
            for axis, (f, t) in enumerate(zip(shape, target)):
                symbol = self.symbols.get(name, [None] * len(shape))[axis]
                if f != t and isinstance(symbol, str):
                    real[symbol] = f
        return padded, real

    def most(self, name: str, axis: int) -> int | None:
        """The largest size input `name`'s dim `axis` may take: its largest gear, the top of its range or its
        fixed size; None where the contract leaves it free."""
        sizes = [gear[name][axis] for gear in self.gears if len(gear.get(name, ())) > axis]
        if sizes:
            return max(sizes)
        dims = self.input_shape.get(name) or []
        dim = dims[axis] if -len(dims) <= axis < len(dims) else -1
        top = dim[1] if isinstance(dim, list) else dim
        return top if top > 0 else None

    def gear(self, batch: int | None = None, dims: dict[str, list[int]] | None = None) -> dict[str, tuple[int, ...]]:
        """The gear msame's `--dymBatch N` (the gear of batch N) or `--dymDims "name:d1,d2;..."` (the gear of
        exactly those shapes) names: each input's shape in it. E10001 when the artifact has no such gear."""
        flag, said, kind = ("--dymBatch", str(batch), "batch") if dims is None else (
            "--dymDims", ";".join(f"{n}:{','.join(map(str, d))}" for n, d in dims.items()), "dims")
        if self.gear_kind != kind:
            raise AtcError("E10001", said, flag, f"the model was not compiled with atc --dynamic_{kind}"
                                                 f"{'_size' if kind == 'batch' else ''}")
        for gear in self.gears:
            if dims is None and all(shape[0] == batch for shape in gear.values()):
                return dict(gear)
            if dims is not None and {n: tuple(d) for n, d in dims.items()} == gear:
                return dict(gear)
        raise AtcError("E10001", said, flag, f"it names none of the gears the model was compiled for: {self._gear_text()}")

    def cut(self, outputs: dict[str, np.ndarray], real: dict[str, int], signature: dict) -> dict[str, np.ndarray]:
        """Outputs with each dim named by a padded input's symbol cut back to that input's real size."""
        if not real:
            return outputs
        symbols = {value["name"]: value["shape"] for value in signature["outputs"]}
        cut = {}
        for name, array in outputs.items():
            index = tuple(slice(0, real[s]) if isinstance(s, str) and s in real else slice(None)
                          for s in symbols.get(name, [None] * array.ndim))
            cut[name] = array[index] if len(index) == array.ndim else array
        return cut

    def _check_dims(self, name: str, shape: tuple[int, ...], dims: list) -> None:
        allowed = ",".join(f"{d[0]}~{d[1]}" if isinstance(d, list) else str(d) for d in dims)
        fed = f"{name}:{','.join(map(str, shape))}"
        if len(shape) != len(dims):
            raise AtcError("E10001", fed, "input shape", f"{name} has {len(dims)} dims ({allowed}) in the compiled model")
        for axis, (size, dim) in enumerate(zip(shape, dims)):
            if isinstance(dim, list) and not dim[0] <= size <= dim[1] or isinstance(dim, int) and dim > 0 and size != dim:
                raise AtcError("E10001", fed, "input shape", f"dimension {axis} must be {_dim_text(dim)} "
                                                             f"(the model was compiled with {name}:{allowed})")

    def _gear_text(self) -> str:
        return " | ".join("; ".join(f"{n}:{','.join(map(str, s))}" for n, s in gear.items()) for gear in self.gears)


def _dim_text(dim) -> str:
    return f"between {dim[0]} and {dim[1]}" if isinstance(dim, list) else str(dim)
