"""`PrecisionPolicy`: what `--precision_mode` and `--keep_dtype` mean on this target (a CPU).

onnxruntime's CPU kernels for everything an LLM graph runs (MatMul, the norms, attention) compute in
float32: given float16 or bfloat16 weights it casts them to float32 when the session loads, so a float16
MatMul takes the float32 time (docs/performance.md#precision-modes). So a mode chooses the dtype the
float weights are *stored* in, in the artifact, never the arithmetic:

| mode | MatMul weights | token-embedding table (and a tied lm_head) |
|---|---|---|
| force_fp16, cube_fp16in_fp32out | float16 | float16 |
| allow_mix_precision, allow_mix_precision_fp16 | float16 | float32 (precision-sensitive, as in ATC's mixed mode) |
| allow_mix_precision_bf16 | bfloat16 | float32 |
| must_keep_origin_dtype | unchanged (a float16 or bfloat16 model's: that dtype) | the same |
| allow_fp32_to_fp16, allow_fp32_to_bf16, force_fp32 | unchanged (a float16 or bfloat16 model's: float32) | the same |

A model computing in float16 or bfloat16 is raised to float32 arithmetic at import
(cann_llm/passes/upcast_float_compute.py); `storing` gives its weights back their dtype where the mode keeps it.
The `allow_fp32_to_*` modes lower only ops that lack a float32 implementation; every op here has one.
Weights outside the target dtype's finite range stay float32 in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cann_llm.runtime.errors import AtcError

_STORAGE = {
    "force_fp16": ("float16", True),
    "cube_fp16in_fp32out": ("float16", True),
    "allow_mix_precision": ("float16", False),
    "allow_mix_precision_fp16": ("float16", False),
    "allow_mix_precision_bf16": ("bfloat16", False),
}
OP_TYPE_PREFIX = "OpType::"


@dataclass(frozen=True)
class PrecisionPolicy:
    """The storage dtype of float weights (None: as in the model), whether the embedding table follows it,
    and the `--keep_dtype` entries: node or weight names (fnmatch globs, `lm_head` for the logits
    projection) and op types whose weights keep their dtype."""

    mode: str = "must_keep_origin_dtype"
    weight_dtype: str | None = None
    convert_table: bool = False
    keep_names: tuple[str, ...] = ()
    keep_op_types: tuple[str, ...] = ()
    exact_only: bool = False  # only weights whose values the dtype holds exactly (a raised model's own)

    @classmethod
    def of(cls, mode: str, keep_dtype: str = "") -> "PrecisionPolicy":
        """The policy of a (validated) mode name and a `--keep_dtype` file (one entry a line, `#` comments)."""
        weight_dtype, convert_table = _STORAGE.get(mode, (None, False))
        names, op_types = _read_keep_dtype(keep_dtype) if keep_dtype else ((), ())
        return cls(mode, weight_dtype, convert_table, names, op_types)

    def storing(self, origin: str | None) -> "PrecisionPolicy":
        """This policy for a model whose weights were mostly in `origin` ("float16", "bfloat16"; None: float32)
        before its arithmetic was raised to float32: must_keep_origin_dtype stores those weights in `origin`
        again, each only if that dtype holds its values exactly (a float32 or other-typed weight beside them
        keeps every bit, in float32)."""
        if origin is None or self.mode != "must_keep_origin_dtype":
            return self
        return replace(self, weight_dtype=origin, convert_table=True, exact_only=True)

    @property
    def stored(self) -> str:
        """How float weights are stored, in words."""
        if self.weight_dtype is None:
            return "its weights are stored as float32"
        where = "" if self.convert_table else ", the embedding table float32"
        if self.exact_only:
            where += f", but as float32 any weight that {self.weight_dtype} does not hold exactly"
        return f"its linear layers' and embedding weights are stored as {self.weight_dtype}{where} (MoE experts' " \
               "and other weights as float32)"


def _read_keep_dtype(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.split("#", 1)[0].strip() for line in handle]
    except (OSError, UnicodeDecodeError) as exc:
        raise AtcError("E10001", path, "keep_dtype", f"The file cannot be read: {exc}") from exc
    names, op_types = [], []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        if line.startswith(OP_TYPE_PREFIX):
            op_type = line[len(OP_TYPE_PREFIX):].strip()
            if not op_type:
                raise AtcError("E10001", path, "keep_dtype", f"Line {number}: {OP_TYPE_PREFIX} names no op type.")
            op_types.append(op_type)
        else:
            names.append(line)
    return tuple(names), tuple(op_types)
