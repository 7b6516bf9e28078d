"""The long fuzz run: N mutated ONNX models through the compiler and N mutated `.om` files through the
loader and one engine step, in worker processes (tests/fuzz/: the mutators, the worker pool).

    python benchmarks/fuzz.py --onnx 10000 --om 10000 [--workers 2] [--seed 0] [--seconds 3600] [--json out.json]
    python benchmarks/fuzz.py --om 1 --seed 1234          # replay one case: case i of a kind has seed --seed + i
    python benchmarks/fuzz.py --replay out.json           # replay the failing cases a summary lists

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
SUMMARY_EVERY = 200  # cases: an interrupted run still leaves its figures in --json


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


class Tally:
    """The outcomes so far, and the summary they make."""

    def __init__(self, workers: int, seed: int, timeout: float, keep: str):
        self.settings = {"workers": workers, "seed": seed, "timeout": timeout}
        self.keep = keep
        self.outcomes, self.codes, self.time = Counter(), Counter(), Counter()
        self.slowest: dict[str, dict] = {}
        self.failures: dict[str, dict] = {}
        self.started = time.monotonic()

    def add(self, case: dict, outcome: dict) -> None:
        kind = case["kind"]
        self.outcomes[f"{kind} {outcome['outcome']}"] += 1
        self.time[kind] += outcome["seconds"]
        if outcome["outcome"] == "refused":
            self.codes[f"{kind} {outcome['code']}"] += 1
        if outcome["seconds"] > self.slowest.get(kind, {}).get("seconds", -1):
            self.slowest[kind] = {"seconds": outcome["seconds"], "seed": case["seed"], "outcome": outcome["outcome"]}
        name = failure_class(outcome)
        if not name:
            return
        entry = self.failures.setdefault(name, {"count": 0, "cases": []})
        entry["count"] += 1
        if len(entry["cases"]) < KEEP_PER_CLASS:
            entry["cases"].append({"kind": kind, "seed": case["seed"], "mutation": " | ".join(case["log"]),
                                   "message": outcome.get("message", "")})
            if self.keep:
                shutil.copytree(Path(case["path"]).parent, Path(self.keep) / f"{kind}-{case['seed']}", dirs_exist_ok=True)

    def summary(self, setup_seconds: float) -> dict:
        elapsed = time.monotonic() - self.started
        counts = Counter()
        for key, value in self.outcomes.items():
            counts[key.split()[0]] += value
        return {
            "date": time.strftime("%Y-%m-%d %H:%M"), **self.settings,
            "cases": dict(counts), "outcomes": dict(sorted(self.outcomes.items())),
            "refusal_codes": dict(sorted(self.codes.items())),
            "failures": dict(sorted(self.failures.items(), key=lambda item: -item[1]["count"])),
            "failed_cases": sum(entry["count"] for entry in self.failures.values()),
            "slowest": self.slowest,
            "mean_case_seconds": {kind: round(self.time[kind] / count, 3) for kind, count in counts.items()},
            "seconds": round(elapsed, 1), "setup_seconds": round(setup_seconds, 1),
            "cases_per_second": round(sum(counts.values()) / elapsed, 2) if elapsed else 0.0,
        }


def _write(summary: dict, json_path: str) -> None:
    if json_path:
        partial = Path(json_path).with_name(Path(json_path).name + ".partial")
        partial.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
        partial.replace(json_path)


def _replayed(summary_path: str, bases, oms, folder: Path):
    """The failing cases a --json summary lists (up to 3 per class), made again from their seeds."""
    makers = {"onnx": lambda c, f: onnx_case(c, bases, f), "om": lambda c, f: om_case(c, oms, f)}
    for entry in json.loads(Path(summary_path).read_text())["failures"].values():
        for listed in entry["cases"]:
            kind, case_seed = listed["kind"], listed["seed"]
            yield {**makers[kind](RandomChoices(case_seed), folder / f"{kind}-{case_seed}"), "seed": case_seed}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--onnx", "onnx_count", default=100, show_default=True, help="mutated ONNX models")
@click.option("--om", "om_count", default=100, show_default=True, help="mutated .om files")
@click.option("--workers", default=2, show_default=True)
@click.option("--seed", default=0, show_default=True, help="seed of the first case of each kind")
@click.option("--seconds", default=0.0, help="stop making new cases after this long (0: no limit)")
@click.option("--timeout", default=30.0, show_default=True, help="seconds one case may take")
@click.option("--json", "json_path", default="", help=f"write the summary here too (and every {SUMMARY_EVERY} cases)")
@click.option("--keep", default="", help="copy the inputs of failing cases here (3 per failure class)")
@click.option("--replay", default="", help="run the failing cases listed in this --json summary instead")
def main(onnx_count: int, om_count: int, workers: int, seed: int, seconds: float, timeout: float, json_path: str,
         keep: str, replay: str) -> None:
    """Fuzz the compiler and the loader; see the module docstring."""
    kinds = {kind: count for kind, count in (("onnx", onnx_count), ("om", om_count)) if count > 0}
    folder = Path(tempfile.mkdtemp(prefix="cann-fuzz-"))
    start = time.monotonic()
    try:
        bases = onnx_bases()
        oms = om_bases(folder / "bases", bases)
        pool = Pool(folder / "pool", workers=workers, timeout=timeout)
        tally = Tally(workers, seed, timeout, keep)
        setup = tally.started - start
        deadline = tally.started + seconds if seconds else float("inf")
        try:
            cases = _replayed(replay, bases, oms, folder) if replay else _cases(kinds, seed, bases, oms, folder, deadline)
            for done, (case, outcome) in enumerate(pool.imap(cases), 1):
                tally.add(case, outcome)
                shutil.rmtree(Path(case["path"]).parent, ignore_errors=True)
                if done % SUMMARY_EVERY == 0:
                    summary = tally.summary(setup)
                    _write(summary, json_path)
                    print(f"{done} cases, {summary['seconds']:.0f} s, {summary['failed_cases']} failures",
                          file=sys.stderr, flush=True)
        finally:
            pool.close()
        summary = tally.summary(setup)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    _write(summary, json_path)
    sys.exit(1 if summary["failures"] else 0)


if __name__ == "__main__":
    main()
