"""What a second process costs before it serves anything: the memory a process adds beside an identical one
that is already running (both PSS summed, minus the first's alone), after each stage of the runtime's imports.

    python benchmarks/process_floor.py [--rounds 3]

The floor under `benchmarks/shared_weights.py`'s figures: whatever a second serving process holds of its
own, it holds at least this much before it loads a session.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"python": "pass", "numpy": "import numpy", "numpy + onnxruntime": "import numpy, onnxruntime",
          "the engine": "import cann_llm.runtime.engine.engine"}


def _pss(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("Pss:")) / 1024


def _start(code: str) -> subprocess.Popen:
    program = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n{code}\nprint(flush=True)\nsys.stdin.readline()"
    process = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    process.stdout.readline()
    return process


def added(code: str) -> float:
    """MiB the second of two processes running `code` adds."""
    first = _start(code)
    alone = _pss(first.pid)
    second = _start(code)
    both = _pss(first.pid) + _pss(second.pid)
    for process in (first, second):
        process.stdin.close()
        process.wait()
    return both - alone


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1))
def main(rounds: int) -> None:
    """Print, for each stage, the memory a second process adds (median over rounds)."""
    for name, code in STAGES.items():
        values = [added(code) for _ in range(rounds)]
        click.echo(f"{name:>22}: a second process adds {statistics.median(values):.1f} MiB "
                   f"({' '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
