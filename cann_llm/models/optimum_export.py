"""Optimum's ONNX export of the tiny test models, in a venv of its own.

optimum-onnx needs transformers<4.58 and fails to import beside transformers 5, so it is installed into
`cache_dir()/optimum-venv` on first use (`python -m venv` + pip; about 30 s from this machine's wheel
cache). `optimum_onnx("llama")` returns the path of Optimum's `text-generation-with-past` export of the
tiny model `cann_llm.models.tiny.build_tiny_model("llama")` — the same weights, saved by this venv and loaded by
transformers 4.57 in the other — exporting it the first time; `export_families()` does several in one
process, and with `form="no-past"` Optimum's `text-generation` export (no cache inputs) or with
`form="merged"` its legacy merged decoder (`decoder_model_merged.onnx`, an `If` on `use_cache_branch`)
instead. The export runs in the optimum venv through `cann_llm/models/optimum_worker.py`.

    python -m cann_llm.models.optimum_export [FAMILY ...]      # create the venvs and export (every form the tests read)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cann_llm.models.tiny import REPO_ROOT, byte_tokenizer_json, cache_dir

# optimum-onnx 0.1.0 was released against transformers 4.57; torch stays at the project's pin
REQUIREMENTS = ("optimum-onnx==0.1.0", "optimum==2.1.0", "transformers==4.57.6", "torch==2.13.0", "accelerate",
                "onnx", "onnxruntime", "ml_dtypes<0.7")  # as pyproject.toml's: 0.7 adds 0.7 s to every start
# the tiny families Optimum can export with `text-generation-with-past`; it has no ONNX config for
# qwen2_moe
OPTIMUM_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma", "qwen3", "glm", "qwen3_moe", "gpt2")
# transformers 5 saves MoE experts as fused 3-D tensors that 4.57 cannot load: these are built in the
# optimum venv by the same build_tiny_model (same sizes and seed, other initial weights)
BUILT_IN_OPTIMUM_VENV = frozenset({"qwen3_moe"})


class OptimumUnavailable(RuntimeError):
    """The optimum venv could not be created (no package registry, say)."""


def venv_dir(legacy: bool = False) -> Path:
    """Where the optimum venv (`legacy`: the one with optimum 1.17) lives."""
    return cache_dir() / ("optimum-legacy-venv" if legacy else "optimum-venv")


def venv_python(legacy: bool = False) -> Path:
    """The optimum venv's interpreter."""
    return venv_dir(legacy) / "bin" / "python"


FORMS = ("with-past", "no-past", "merged", "legacy", "legacy-merged")  # cann_llm/models/optimum_worker.py says what each is
# optimum 1.17 with transformers 4.37, as most ONNX files on the Hugging Face Hub were made (the "legacy"
# forms); it exports llama, mistral and gpt2 of the tiny families (it has no Qwen2 config, 4.37 no Gemma or
# Phi-3), GPT-2 with eager attention, as 4.37 has no other for it
LEGACY_REQUIREMENTS = ("optimum==1.17.1", "transformers==4.37.2", "torch==2.13.0", "onnx", "onnxruntime",
                       "numpy<2")
LEGACY_FAMILIES = ("llama", "mistral", "gpt2")
# the families the test suite reads in each form: the forms without a cache and the merged decoders on
# rotary with and without position_ids, and learned positions
ROTARY_AND_LEARNED = ("llama", "gemma", "gpt2")
FORM_FAMILIES = {"with-past": OPTIMUM_FAMILIES, "no-past": ROTARY_AND_LEARNED, "merged": ROTARY_AND_LEARNED,
                 "legacy": LEGACY_FAMILIES, "legacy-merged": LEGACY_FAMILIES}


def export_dir(family: str, seed: int = 0, form: str = "with-past") -> Path:
    """The folder of one family's Optimum export in `form`."""
    return cache_dir() / "optimum" / f"{family}{'' if form == 'with-past' else '-' + form}-s{seed}"


def export_paths(families, seed: int = 0, form: str = "with-past") -> dict[str, Path]:
    """Each family's model file in `form`, made or not."""
    return {family: export_dir(family, seed, form) / _model_file(form) for family in families}


def _model_file(form: str) -> str:
    return "decoder_model_merged.onnx" if form.endswith("merged") else "model.onnx"


def _locked(name: str):
    """One process at a time (parallel test workers share the cache)."""
    from cann_llm.runtime.made_once import exclusive  # importing the runtime package starts onnxruntime: only when needed

    return exclusive(cache_dir() / f".{name}.lock")


def ensure_optimum_venv(log=print, legacy: bool = False) -> Path:
    """The optimum venv's python (`legacy`: the one with optimum 1.17), creating the venv if it is missing or
    was made for other requirements.

    Idempotent: a marker inside the venv records what was installed. Raises OptimumUnavailable if pip fails.
    """
    requirements, folder, python = LEGACY_REQUIREMENTS if legacy else REQUIREMENTS, venv_dir(legacy), venv_python(legacy)
    marker = folder / ".installed"
    wanted = "\n".join(requirements) + "\n"
    if marker.is_file() and marker.read_text() == wanted and python.exists():
        return python
    with _locked(folder.name):
        if marker.is_file() and marker.read_text() == wanted and python.exists():
            return python
        start = time.perf_counter()
        log(f"creating {folder} for Optimum ({', '.join(requirements)}) ...")
        shutil.rmtree(folder, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(folder)], "python -m venv", folder)
        _run([str(python), "-m", "pip", "install", "--progress-bar", "off", *requirements], "pip install", folder, log)
        marker.write_text(wanted)
        log(f"created {folder} in {time.perf_counter() - start:.0f} s")
    return python


def _run(command: list[str], what: str, folder: Path, log=None) -> None:
    """Run a set-up step of the venv in `folder`, echoing pip's 'Collecting'/'Installing' lines as progress."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        if log is not None and line.startswith(("Collecting", "Installing", "Successfully")):
            log("  " + line.rstrip())
    if process.wait() != 0:
        shutil.rmtree(folder, ignore_errors=True)
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        raise OptimumUnavailable(f"{what} failed (exit {process.returncode}): {errors[-1] if errors else 'no output'}")


def optimum_onnx(family: str, seed: int = 0) -> Path:
    """Path of Optimum's export of the tiny `family` model (its byte tokenizer beside it), made on first use."""
    return export_families([family], seed)[family]


def export_families(families, seed: int = 0, log=print, form: str = "with-past") -> dict[str, Path]:
    """Optimum's exports of several tiny families in `form` (FORMS), the missing ones made in one run of the
    optimum venv."""
    if form not in FORMS:
        raise ValueError(f"no Optimum form {form!r}: one of {', '.join(FORMS)}")
    legacy = form.startswith("legacy")
    exported = LEGACY_FAMILIES if legacy else OPTIMUM_FAMILIES
    unknown = [f for f in families if f not in exported]
    if unknown:
        raise ValueError(f"Optimum ({form}) does not export {', '.join(unknown)} here; it exports {', '.join(exported)}")
    paths = export_paths(families, seed, form)
    if all(path.exists() for path in paths.values()):
        return paths
    python = ensure_optimum_venv(log, legacy)
    with _locked("optimum-export"):
        missing = [family for family, path in paths.items() if not path.exists()]
        if missing:
            _export(python, missing, seed, log, form)
    return paths


def _export(python: Path, families: list[str], seed: int, log, form: str) -> None:
    root = cache_dir() / "optimum"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".staging-") as staging:
        staging = Path(staging)
        jobs = []
        for family in families:
            checkpoint = "build"
            if family not in BUILT_IN_OPTIMUM_VENV and not form.startswith("legacy"):
                from cann_llm.models.tiny import build_tiny_model

                checkpoint = str(staging / "checkpoints" / family)
                build_tiny_model(family, seed).save_pretrained(checkpoint)
            jobs += [family, checkpoint, str(staging / family)]
        start = time.perf_counter()
        log(f"exporting {', '.join(families)} with Optimum ({form}) ...")
        result = subprocess.run([str(python), "-m", "cann_llm.models.optimum_worker", f"--form={form}", str(seed), *jobs],
                                cwd=REPO_ROOT, env=_worker_env(), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"Optimum's export failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        log(f"exported {len(families)} families with Optimum in {time.perf_counter() - start:.1f} s")
        for family in families:
            (staging / family / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
            final = export_dir(family, seed, form)
            shutil.rmtree(final, ignore_errors=True)
            (staging / family).replace(final)


def _worker_env() -> dict[str, str]:
    """The optimum venv must see this repository (cann_llm.models.tiny) and nothing of the main venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def every_form_exported() -> bool:
    """Whether the cache holds every form's exports of its FORM_FAMILIES."""
    return all(path.exists() for form, families in FORM_FAMILIES.items()
               for path in export_paths(families, form=form).values())


def export_every_form(log=print) -> tuple[dict[str, dict[str, Path]], dict[str, str]]:
    """Every form's exports of its FORM_FAMILIES (what the test suite reads) by form, and the forms left out
    with why: a venv that cannot be created (no package registry, say) is tried once and leaves out its
    forms; the tests that need them skip and say why, and the rest of the suite still runs."""
    made, skipped, unavailable = {}, {}, {}
    for form, families in FORM_FAMILIES.items():
        legacy = form.startswith("legacy")
        if legacy in unavailable:
            skipped[form] = unavailable[legacy]
            continue
        try:
            made[form] = export_families(families, log=log, form=form)
        except OptimumUnavailable as error:
            skipped[form] = unavailable[legacy] = str(error)
    return made, skipped


def main(argv: list[str] | None = None) -> None:
    """Create the optimum venvs and export FAMILY ... (default: every form's families the tests read)."""
    families = argv if argv is not None else sys.argv[1:]
    if {"-h", "--help"} & set(families):
        print(f"usage: python -m cann_llm.models.optimum_export [FAMILY ...]\n\n{main.__doc__}\n"
              f"families: {' '.join(OPTIMUM_FAMILIES)}")
        return
    if not families:
        made, skipped = export_every_form()
    else:
        try:
            made, skipped = {"with-past": export_families(families)}, {}
        except OptimumUnavailable as error:
            made, skipped = {}, {"with-past": str(error)}
    for form, paths in made.items():
        for family, path in paths.items():
            print(f"{family} ({form}): {path}")
    for form, why in skipped.items():
        print(f"warning: Optimum's {form} exports cannot be made, their tests will be skipped: {why}", file=sys.stderr)


if __name__ == "__main__":
    main()
