"""The long fuzz run: N mutated ONNX models through the compiler and N mutated `.om` files through the
loader and one engine step, in worker processes (tests/fuzz/: the mutators, the worker pool).

    python benchmarks/fuzz.py --onnx 10000 --om 10000 [--workers 2] [--seed 0] [--seconds 3600] [--json out.json]
    python benchmarks/fuzz.py --om 1 --seed 1234          # replay one case: case i of a kind has seed --seed + i

A case passes when it succeeds or raises AtcError with a code other than E19999; an exception of another
type, a dead worker (a segfault) or a case over --timeout seconds (default 30) is a failure, listed with
its seeds and what the mutation did. Prints (and with --json writes) the outcomes by kind, the refusal
codes, the failure classes, the slowest case of each kind and the throughput; exits 1 if anything failed.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fuzz"))
from fuzz_choices import RandomChoices  # noqa: E402
from fuzz_corpus import failure_class, om_bases, om_case, onnx_bases, onnx_case  # noqa: E402
from fuzz_pool import Pool  # noqa: E402

KEEP_PER_CLASS = 3


def _cases(kinds: dict[str, int], seed: int, bases, oms, folder: Path, deadline: float):
    """The cases, the kinds interleaved in proportion to their counts, until the counts or the time run out."""
    makers = {"onnx": lambda c, f: onnx_case(c, bases, f), "om": lambda c, f: om_case(c, oms, f)}
    total = sum(kinds.values())
    made = Counter()
    for step in itertools.count():
        if time.monotonic() > deadline or sum(made.values()) == total:
            return
        # the kind furthest behind its share goes next
        kind = min((k for k in kinds if made[k] < kinds[k]), key=lambda k: made[k] / kinds[k])
        case_seed = seed + made[kind]
        made[kind] += 1
        case = makers[kind](RandomChoices(case_seed), folder / f"{kind}-{case_seed}")
        yield {**case, "seed": case_seed, "step": step}


@click.command()
@click.option("--onnx", "onnx_count", default=100, show_default=True, help="mutated ONNX models")
@click.option("--om", "om_count", default=100, show_default=True, help="mutated .om files")
@click.option("--workers", default=2, show_default=True)
@click.option("--seed", default=0, show_default=True, help="seed of the first case of each kind")
@click.option("--seconds", default=0.0, help="stop making new cases after this long (0: no limit)")
@click.option("--timeout", default=30.0, show_default=True, help="seconds one case may take")
@click.option("--json", "json_path", default="", help="write the summary here too")
@click.option("--keep", default="", help="copy the inputs of failing cases here (3 per failure class)")
def main(onnx_count: int, om_count: int, workers: int, seed: int, seconds: float, timeout: float, json_path: str,
         keep: str) -> None:
    """Fuzz the compiler and the loader; see the module docstring."""
    kinds = {kind: count for kind, count in (("onnx", onnx_count), ("om", om_count)) if count > 0}
    folder = Path(tempfile.mkdtemp(prefix="cann-fuzz-"))
    start = time.monotonic()
    try:
        bases = onnx_bases()
        oms = om_bases(folder / "bases", bases)
        pool = Pool(folder / "pool", workers=workers, timeout=timeout)
        ready = time.monotonic()
        outcomes, codes, slowest = Counter(), Counter(), {}
        failures: dict[str, dict] = {}
        deadline = ready + seconds if seconds else float("inf")
        try:
            for done, (case, outcome) in enumerate(pool.imap(_cases(kinds, seed, bases, oms, folder, deadline)), 1):
                kind = case["kind"]
                outcomes[f"{kind} {outcome['outcome']}"] += 1
                if outcome["outcome"] == "refused":
                    codes[f"{kind} {outcome['code']}"] += 1
                if outcome["seconds"] > slowest.get(kind, {}).get("seconds", -1):
                    slowest[kind] = {"seconds": outcome["seconds"], "seed": case["seed"], "outcome": outcome["outcome"]}
                name = failure_class(outcome)
                if name:
                    entry = failures.setdefault(name, {"count": 0, "cases": []})
                    entry["count"] += 1
                    if len(entry["cases"]) < KEEP_PER_CLASS:
                        entry["cases"].append({"kind": kind, "seed": case["seed"], "mutation": " | ".join(case["log"]),
                                               "message": outcome.get("message", "")})
                        if keep:
                            shutil.copytree(Path(case["path"]).parent, Path(keep) / f"{kind}-{case['seed']}", dirs_exist_ok=True)
                shutil.rmtree(Path(case["path"]).parent, ignore_errors=True)
                if done % 200 == 0:
                    failed = sum(f["count"] for f in failures.values())
                    print(f"{done} cases, {time.monotonic() - ready:.0f} s, {failed} failures",
                          file=sys.stderr, flush=True)
        finally:
            pool.close()
        elapsed = time.monotonic() - ready
        counts = Counter()
        for key, value in outcomes.items():
            counts[key.split()[0]] += value
        summary = {
            "date": time.strftime("%Y-%m-%d"), "workers": workers, "seed": seed, "timeout": timeout,
            "cases": dict(counts), "outcomes": dict(sorted(outcomes.items())), "refusal_codes": dict(sorted(codes.items())),
            "failures": dict(sorted(failures.items(), key=lambda item: -item[1]["count"])), "slowest": slowest,
            "seconds": round(elapsed, 1), "setup_seconds": round(ready - start, 1),
            "cases_per_second": {kind: round(count / elapsed, 2) for kind, count in counts.items()} if elapsed else {},
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = json.dumps(summary, indent=2, ensure_ascii=False)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    sys.exit(1 if summary["failures"] else 0)


if __name__ == "__main__":
    main()
