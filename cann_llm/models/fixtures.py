"""The exports the test suite reads, made into the cache before it runs (`make test` runs this first):
SmolLM2's export, every tiny family through each exporter (TINY_EXPORTS), and Optimum's exports in each form
the tests read. Each is made exactly as the tests would make it on first use (`cann_llm.models.tiny.tiny_onnx`,
`cann_llm.models.prepare.prepare_smollm2`, `cann_llm.models.optimum_export`), so a suite run without this step makes them
itself, one at a time inside its tests; here they are made on --jobs processes, the longest first, and those
already in the cache are skipped.

    python -m cann_llm.models.fixtures [--jobs 2]
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed

import click

from cann_llm.models.recipes import RECIPES
from cann_llm.models.tiny import ATTENTIONS, TINY_FAMILIES, cache_dir


def _tiny_exports() -> list[tuple[str, bool, bool, str]]:
    return [(family, dynamo, with_past, attention) for family in TINY_FAMILIES for dynamo in (False, True)
            for with_past in (False, True) for attention in ATTENTIONS
            if ("dynamo" if dynamo else "ts") in RECIPES[family].exporters
            and not (dynamo and not with_past and attention == "eager")]


# every tiny family × exporter × {prefill, KV cache} × {sdpa, eager} (family, dynamo, with_past, attention), but
# for one corner: a dynamo export costs ~6 s of a core whatever the model's size (a TorchScript one ~0.3 s), so
# the dynamo exports without a KV cache are sdpa's alone (transformers' default); eager attention through dynamo
# is its KV-cache exports', and eager without a cache TorchScript's, so every pair of the three choices is
# still tested
TINY_EXPORTS = _tiny_exports()


def _smollm2() -> str:
    from cann_llm.models.prepare import smollm2_onnx

    smollm2_onnx()
    return ""


def _optimum() -> str:
    from cann_llm.models.optimum_export import export_every_form

    _, skipped = export_every_form(log=lambda message: None)
    return "".join(f"; its {form} form not made, its tests will skip: {why[:300]}" for form, why in skipped.items())


def _tiny(family: str, dynamo: bool, with_past: bool, attention: str) -> str:
    from cann_llm.models.tiny import tiny_onnx

    tiny_onnx(family, dynamo=dynamo, with_past=with_past, attention=attention)
    return ""


def label(job: tuple) -> str:
    """What a job makes, in words."""
    function, *arguments = job
    if function is _tiny:
        family, dynamo, with_past, attention = arguments
        return (f"tiny {family} ({'dynamo' if dynamo else 'TorchScript'}, {'KV cache' if with_past else 'prefill'}, "
                f"{attention})")
    return {_smollm2: "SmolLM2-135M-Instruct (dynamo, KV cache)", _optimum: "Optimum's exports"}[function]


def _make(job: tuple) -> str:
    """One job, in a worker: a failure comes back as a RuntimeError naming the export (an exporter's own
    exception may not survive the way back between processes), its traceback in the log."""
    function, *arguments = job
    try:
        return function(*arguments)
    except Exception as error:
        traceback.print_exc()
        raise RuntimeError(f"{label(job)}: {type(error).__name__}: {error}") from None


def _quiet(log: str) -> None:
    """A worker's own output (exporters' progress, warnings) goes to `log`, not between the progress lines."""
    handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(handle, 1)
    os.dup2(handle, 2)
    os.close(handle)


def missing_jobs() -> list[tuple]:
    """The exports the cache lacks, each as (function, *arguments), the longest first: Optimum's venvs and
    exports (minutes on a fresh machine), SmolLM2's, then the tiny dynamo exports and the TorchScript ones."""
    from cann_llm.models.optimum_export import every_form_exported
    from cann_llm.models.prepare import smollm2_dir
    from cann_llm.models.tiny import tiny_onnx_path

    work = [] if every_form_exported() else [(_optimum,)]
    work += [] if (smollm2_dir() / "model.onnx").exists() else [(_smollm2,)]
    return work + [(_tiny, *case) for case in sorted(TINY_EXPORTS, key=lambda case: not case[1])
                   if not tiny_onnx_path(case[0], dynamo=case[1], with_past=case[2], attention=case[3]).exists()]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--jobs", "processes", default=2, show_default=True, help="exports made at once")
def main(processes: int) -> None:
    """Make every export the test suite reads that the cache does not hold yet. An export that fails is named
    and the others are still made; the test asking for it makes it again and shows why it fails."""
    work = missing_jobs()
    if not work:
        click.echo(f"the test suite's exports are in {cache_dir()}")
        return
    start = time.perf_counter()
    log = cache_dir() / "fixtures.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    click.echo(f"making {len(work)} exports the test suite reads, {processes} at a time (their output: {log}) ...")
    failed = []
    # spawned workers: no torch state forked from this process
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet,
                             initargs=(str(log),)) as pool:
        pending = {pool.submit(_make, job): job for job in work}
        for done, future in enumerate(as_completed(pending), 1):
            try:
                said = f"{label(pending[future])}{future.result()}"
            except Exception as error:
                failed.append(error)
                said = f"FAILED {error}"
            click.echo(f"[{done}/{len(work)}] {said} ({time.perf_counter() - start:.0f} s)")
    for error in failed:
        click.echo(f"warning: not made, its tests will make it again and show why ({log} has the traceback): "
                   f"{error}", err=True)
    click.echo(f"the test suite's exports are in {cache_dir()} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
