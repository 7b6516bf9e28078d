"""Mutated ONNX models through `compile_model`, mutated `.om` files (checksums repaired) through the loader
and one engine step: every case ends in success or a coded AtcError, never another exception, a crash of
the worker process or a hang over 30 s. The long run is benchmarks/fuzz.py (docs/reliability.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from fuzz_choices import HypothesisChoices
from fuzz_corpus import failure_class, om_bases, om_case, onnx_bases, onnx_case
from fuzz_om import METADATA, MODEL_DEF, OmImage
from fuzz_pool import Pool
from fuzz_report import describe
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

ONNX_CASES = 40
OM_CASES = 200

# CI runs the same cases every time (derandomized, no example database), and does not shrink: a failing case
# is reported with what its mutation did (its log), and the run goes on, so one run lists every class
CI_SETTINGS = settings(derandomize=True, database=None, deadline=None, phases=(Phase.explicit, Phase.generate),
                       suppress_health_check=list(HealthCheck), print_blob=False)


@pytest.fixture(scope="module")
def fuzz_onnx_bases():
    return onnx_bases()


@pytest.fixture(scope="module")
def fuzz_om_bases(tmp_path_factory, fuzz_onnx_bases):
    return om_bases(tmp_path_factory.mktemp("fuzz-bases"), fuzz_onnx_bases)


@pytest.fixture(scope="module")
def fuzz_pool(tmp_path_factory):
    pool = Pool(tmp_path_factory.mktemp("fuzz-pool"), workers=1)
    yield pool
    pool.close()


def _fuzz(pool, make_case, examples: int, folder) -> list:
    failures, counter = [], iter(range(10**9))

    @settings(CI_SETTINGS, max_examples=examples)
    @given(st.data())
    def one(data):
        case = make_case(HypothesisChoices(data), folder / str(next(counter)))
        outcome = pool.run(case)
        name = failure_class(outcome)
        if name:
            failures.append((name, case, outcome))
        else:  # a failing case's files stay, to be looked at
            shutil.rmtree(Path(case["path"]).parent)

    one()
    return failures


def test_mutated_onnx_models_compile_or_are_refused_with_a_code(fuzz_pool, fuzz_onnx_bases, tmp_path):
    failures = _fuzz(fuzz_pool, lambda c, folder: onnx_case(c, fuzz_onnx_bases, folder), ONNX_CASES, tmp_path)
    assert not failures, describe(failures)


def test_mutated_artifacts_load_and_step_or_are_refused_with_a_code(fuzz_pool, fuzz_om_bases, tmp_path):
    failures = _fuzz(fuzz_pool, lambda c, folder: om_case(c, fuzz_om_bases, folder), OM_CASES, tmp_path)
    assert not failures, describe(failures)


def _crafted(data: bytes, path, node_attributes: dict | None = None, metadata: dict | None = None):
    """`data` with custom-node attributes or metadata values set, every checksum made valid again."""
    image = OmImage.parse(data)
    if node_attributes:
        part = image.part(MODEL_DEF)
        model = onnx.ModelProto.FromString(part[1])
        for node in model.graph.node:
            for attr in node.attribute:
                if (node.op_type, attr.name) in node_attributes:
                    attr.i = node_attributes[node.op_type, attr.name]
        part[1] = model.SerializeToString()
    if metadata:
        part = image.part(METADATA)
        values = json.loads(part[1])
        for (section, key), value in metadata.items():
            values[section][key] = value
        part[1] = json.dumps(values).encode()
    path.write_bytes(image.build())
    return {"kind": "om", "path": str(path), "log": [f"{node_attributes or metadata}"]}


# the crafted files: kv_num_heads = 2^31 segfaulted, 5 wrote out of bounds
@pytest.mark.parametrize("base, op, attribute, value", [
    ("llama-flash", "FusedAttention", "kv_num_heads", 2**31), ("llama-flash", "FusedAttention", "kv_num_heads", 5),
    ("llama-flash", "FusedAttention", "num_heads", 0), ("llama-flash", "FusedAttention", "head_dim", 1 << 20),
    ("llama-paged", "PagedAttention", "kv_num_heads", 2**31), ("llama-paged", "PagedAttention", "kv_num_heads", 5),
    ("llama-paged", "PagedAttention", "page_size", 7), ("llama-paged", "PagedAttention", "layer", 9),
])
def test_crafted_attention_attributes_are_refused_before_a_kernel_runs(fuzz_pool, fuzz_om_bases, tmp_path, base, op,
                                                                        attribute, value):
    case = _crafted(fuzz_om_bases[base], tmp_path / "crafted.om", node_attributes={(op, attribute): value})
    outcome = fuzz_pool.run(case)
    assert outcome == {"outcome": "refused", "code": "E13015", "seconds": outcome["seconds"]}, outcome


@pytest.mark.parametrize("key, value", [("num_kv_heads", 2**31), ("num_kv_heads", 5), ("head_dim", -1),
                                        ("num_layers", 10**9), ("num_heads", "4")])
def test_crafted_model_dimensions_are_refused(fuzz_pool, fuzz_om_bases, tmp_path, key, value):
    case = _crafted(fuzz_om_bases["llama-paged"], tmp_path / "crafted.om", metadata={("model", key): value})
    outcome = fuzz_pool.run(case)
    assert outcome == {"outcome": "refused", "code": "E13015", "seconds": outcome["seconds"]}, outcome
