"""`cann-run`: execute a `.om` the way msame and ais_bench do, plus LLM conveniences.

    cann-run --model x.om [--input a.npy,b.bin] [--output DIR] [--outfmt NPY|BIN|TXT] [--loop N]
    cann-run --model x.om --prompt "text" [--topk 5]       # next-token distribution of a prompt

    cann-run generate --model x.om --prompt "text"          # generate text (cann_llm/cli/llm_commands.py)
    cann-run chat --model x.om                              # multi-turn, through the chat template
    cann-run bench --model x.om [--onnx model.onnx]         # throughput and latency (cann_llm/cli/bench.py)
    cann-run serve --model name=x.om [--port 8000]           # HTTP: /generate, OpenAI API (cann_llm/cli/serve.py)
    cann-run export --model HF_DIR|x.gguf --output DIR       # a checkpoint → DIR/model.onnx for atc (cann_llm/cli/export.py)

`cann-run --model ...` is `cann-run run --model ...`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import numpy as np

from cann_llm.cli.coded_errors import main_with_codes
from cann_llm.cli.common_options import CONTEXT_SETTINGS, EXISTING_FILE, log_level_option, shows_progress
from cann_llm.cli.json_output import write_json
from cann_llm.cli.loading import loading
from cann_llm.cli.text_inputs import checked_text
from cann_llm.models.data_files import EVAL_TEXT
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.executor import BACKENDS, Executor
from cann_llm.runtime.feeds import causal_lm_inputs, compiled_shapes, made_up_inputs, page_pool, parse_shapes, read_input_files
from cann_llm.runtime.kernels.paged_attention import PagedInputError
from cann_llm.runtime.loader import LoadedModel, load_artifact
from cann_llm.runtime.safe_files import atomic_writer, make_dir, read_text, write_text
from cann_llm.runtime.shape_contract import ShapeContract


class _RunByDefault(click.Group):
    """msame-style calls (`cann-run --model x.om`, options first) go to the `run` subcommand; `cann-run` alone
    lists the commands; a first word that is no option must name a command. Every subcommand gets
    `--log-level`, `-h` and both spellings of its long options."""

    def parse_args(self, ctx, args):
        if args and args[0].startswith("-") and args[0] not in ("--help", "-h", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        # the settings too, not only through the group's context: a subcommand's own context has them then
        cmd.context_settings = {**CONTEXT_SETTINGS, **cmd.context_settings}
        super().add_command(log_level_option(cmd), name)


@click.group(cls=_RunByDefault, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="cann-llm")
def cli() -> None:
    """Run models compiled by atc (execution is on the host CPU)."""


def _stats(times_ms: list[float]) -> dict:
    values = np.asarray(times_ms)
    return {"min": float(values.min()), "max": float(values.max()), "mean": float(values.mean()),
            "median": float(np.median(values)), "percentile(99%)": float(np.percentile(values, 99))}


def _summary_lines(stats: dict, batch: int) -> list[str]:
    mean = stats["mean"]
    return [
        "[INFO] -----------------Performance Summary------------------",
        "[INFO] NPU_compute_time (ms): " + ", ".join(f"{k} = {v:.4f}" for k, v in stats.items()),
        f"[INFO] throughput 1000*batchsize.mean({batch})/NPU_compute_time.mean({mean}): {1000 * batch / mean}",
        "[INFO] ------------------------------------------------------",
    ]


def _second() -> str:
    """This second, as ais_bench names its output folders."""
    return time.strftime("%Y_%m_%d-%H_%M_%S")


def _fresh_folder(parent: Path) -> Path:
    """A new folder in `parent` named for this second, as ais_bench names it, with `_1`, `_2`, … where runs
    started in the same second took it: parallel runs never write into one folder."""
    make_dir(parent)
    stamp = _second()
    number = 0
    while True:
        folder = parent / (f"{stamp}_{number}" if number else stamp)
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            number += 1
        except OSError as error:
            raise AtcError("E13004", folder, error.strerror) from None


def _save_outputs(outputs: dict[str, np.ndarray], folder: Path, prefix: str, outfmt: str) -> list[str]:
    make_dir(folder)
    written = []
    for index, array in enumerate(outputs.values()):
        path = folder / f"{prefix}_{index}.{outfmt.lower()}"
        with atomic_writer(path) as handle:
            if outfmt == "NPY":
                np.save(handle, array)
            elif outfmt == "BIN":
                array.tofile(handle)
            else:
                np.savetxt(handle, array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array.reshape(1, -1))
        written.append(str(path))
    return written


def _top_tokens(loaded: LoadedModel, executor: Executor, prompt: str, topk: int) -> list[str]:
    from cann_llm.runtime.tokenizer import TextTokenizer

    dims = loaded.metadata.get("model", {})
    if not dims:
        raise AtcError("E10001", "--prompt", "--model", "the model is not a causal LM with input_ids and logits")
    # without a tokenizer.json, TextTokenizer's own refusal says how to compile one in
    tokenizer = loaded.tokenizer or TextTokenizer(loaded.om.tokenizer_files())
    ids = np.asarray([tokenizer.encode(prompt)], dtype=np.int64)
    page_size = loaded.kv_cache.get("page_size")
    feeds = causal_lm_inputs(loaded.metadata["signature"], dims, ids, page_size=page_size)
    kv_cache = page_pool(loaded.metadata, feeds) if loaded.paged else None
    logits = executor.run(feeds, ["logits"], kv_cache=kv_cache)["logits"]
    # the last position's row: [1, S, V] from a contiguous artifact, [1, V] (one sequence) from a paged one
    logits = logits.reshape(-1, logits.shape[-1])[-1]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-logits, kind="stable")[:topk]
    lines = [f"prompt: {prompt!r} ({ids.shape[1]} tokens)", f"top-{topk} next tokens:"]
    lines += [f"  {rank}. {tokenizer.token_text(int(t))!r:<16} id={int(t):<6} p={probs[t]:.4f} logit={logits[t]:.3f}"
              for rank, t in enumerate(order, 1)]
    return lines


def _run_once(executor: Executor, feeds: dict[str, np.ndarray], kv_cache) -> dict[str, np.ndarray]:
    """One forward pass; attention metadata the kernels refuse (from --input files) is the user's error."""
    try:
        return executor.run(feeds, kv_cache=kv_cache)
    except PagedInputError as error:
        raise AtcError("E10001", "attention metadata", "--input", str(error)) from None


@cli.command("run")
@click.option("--model", "-m", required=True, help="the .om to run")
@click.option("--input", "-i", "input_files", default=None, help="comma-separated .npy/.bin files, one per input")
@click.option("--output", "-o", default=None, help="folder for outputs (a timestamped subfolder is made)")
@click.option("--output_dirname", default=None, help="name of that subfolder instead of the timestamp")
@click.option("--outfmt", type=click.Choice(["NPY", "BIN", "TXT"], case_sensitive=False), default="BIN",
              show_default=True)
@click.option("--loop", "-l", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--warmup_count", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--pure_data_type", type=click.Choice(["zero", "random"]), default="zero", show_default=True,
              help="made-up inputs when --input is absent")
@click.option("--dymShape", "dym_shape", default="", help='shapes of dynamic inputs: "input_ids:1,16;..."')
@click.option("--dymBatch", "dym_batch", type=click.IntRange(min=1), default=None,
              help="run at the gear of this batch size (atc --dynamic_batch_size), as msame takes it")
@click.option("--dymDims", "dym_dims", default="",
              help='run at the gear of these shapes (atc --dynamic_dims): "input_ids:1,16;attention_mask:1,16"')
@click.option("--batchsize", type=click.IntRange(min=1), default=1, show_default=True, help="for throughput only")
@click.option("--backend", type=click.Choice(BACKENDS), default="onnxruntime", show_default=True)
@click.option("--prompt", default=None, help="tokenize this text and print the most likely next tokens")
@click.option("--topk", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--device", "-d", default="0",
              help="accepted for msame compatibility; no effect here: execution is on the host CPU")
def run_command(model, input_files, output, output_dirname, outfmt, loop, warmup_count, pure_data_type,
                dym_shape, dym_batch, dym_dims, batchsize, backend, prompt, topk, device) -> None:
    """Execute a compiled model once or in a loop and report its timing."""
    del device
    loaded = load_artifact(model)
    click.echo(f"[INFO] load model {model} success")
    executor = Executor(loaded, backend)
    if prompt is not None:
        if not checked_text(prompt, "--prompt"):
            raise AtcError("E10001", "''", "--prompt", "The prompt is empty: give text whose next token to rank.")
        for line in _top_tokens(loaded, executor, prompt, topk):
            click.echo(line)
        return
    signature, shapes = loaded.metadata["signature"], parse_shapes(dym_shape)
    names = [value["name"] for value in signature["inputs"]]
    unknown = next((name for name in shapes if name not in names), None)
    if unknown is not None:
        raise AtcError("E10016", unknown, "dymShape")
    if dym_batch is not None and dym_dims:
        raise AtcError("E10001", dym_dims, "--dymDims", "--dymBatch and --dymDims name a gear each: give one")
    if dym_batch is not None or dym_dims:
        contract = ShapeContract.of(loaded.metadata) or ShapeContract({}, (), {})  # no gears: refused below
        gear = contract.gear(dym_batch, parse_shapes(dym_dims, "--dymDims") if dym_dims else None)
        shapes = {**shapes, **{name: list(shape) for name, shape in gear.items()}}
    if input_files:
        feeds = read_input_files(input_files.split(","), signature, shapes)
    else:
        # msame's made-up inputs take the compiled shapes (the smallest gear) unless told otherwise
        compiled = compiled_shapes(ShapeContract.of(loaded.metadata)) if not (dym_batch or dym_dims) else {}
        feeds = made_up_inputs(signature, loaded.metadata.get("model", {}), {**compiled, **shapes}, pure_data_type,
                               page_size=loaded.kv_cache.get("page_size"))
    # a paged artifact's keys and values live in a pool the runtime owns: one sized for the feeds' pages
    kv_cache = page_pool(loaded.metadata, feeds) if loaded.paged else None
    for _ in range(warmup_count):
        _run_once(executor, feeds, kv_cache)
    if warmup_count:
        click.echo(f"[INFO] warm up {warmup_count} done")
    times_ms = []
    for _ in range(loop):
        start = time.perf_counter()
        outputs = _run_once(executor, feeds, kv_cache)
        times_ms.append((time.perf_counter() - start) * 1000)
    stats = _stats(times_ms)
    for line in _summary_lines(stats, batchsize):
        click.echo(line)
    if output:
        folder = Path(output) / output_dirname if output_dirname else _fresh_folder(Path(output))
        prefix = Path(input_files.split(",")[0]).stem if input_files else "pure_infer_data"
        files = _save_outputs(outputs, folder, prefix, outfmt.upper())
        summary = {"model": model, "backend": backend, "loop": loop, "warmup_count": warmup_count,
                   "batchsize": batchsize, "NPU_compute_time": stats, "throughput": 1000 * batchsize / stats["mean"],
                   "outputs": {k: list(v.shape) for k, v in outputs.items()}, "files": files}
        write_text(folder.parent / f"{folder.name}_summary.json", json.dumps(summary, indent=2) + "\n")
        click.echo(f"[INFO] output path:{folder}")


@cli.command("eval-ppl")
@click.option("--model", "-m", required=True, help="the .om to evaluate (with its tokenizer)")
@click.option("--text", "text_file", default=str(EVAL_TEXT), type=EXISTING_FILE,
              help="a UTF-8 text file  [default: the shipped held-out text, cann_llm/models/data/eval.txt]")
@click.option("--window", type=click.IntRange(min=2), default=512, show_default=True)
@click.option("--stride", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max_tokens", type=click.IntRange(min=2), default=None, help="score only the first N tokens")
@click.option("--backend", type=click.Choice(BACKENDS), default="onnxruntime", show_default=True)
@click.option("--json", "json_path", default=None,
              help="also write the result here; - is stdout (the summary line then goes to stderr)")
def eval_ppl_command(model, text_file, window, stride, max_tokens, backend, json_path) -> None:
    """Perplexity of the model on a text, sliding window."""
    from cann_llm.runtime.perplexity import perplexity
    from cann_llm.runtime.tokenizer import TextTokenizer

    with loading(model):
        loaded = load_artifact(model)
        executor = Executor(loaded, backend)
    ids = TextTokenizer(loaded.om.tokenizer_files()).encode(read_text(text_file))
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:  # the first token is never scored: nothing would be
        raise AtcError("E10001", text_file, "--text", f"It has {len(ids)} tokens; perplexity needs at least 2.")
    start = time.perf_counter()
    result = perplexity(executor, ids, window, min(stride, window), show_progress=shows_progress())
    seconds = time.perf_counter() - start
    click.echo(f"perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens "
               f"({result.windows} windows of {window}, stride {stride}, {seconds:.1f} s)", err=json_path == "-")
    if json_path:
        write_json(json_path, {"model": model, "text": text_file, "perplexity": result.perplexity,
                               "tokens": result.tokens_scored, "window": window, "stride": stride, "seconds": seconds})


def _add_llm_commands() -> None:
    from cann_llm.cli.bench import bench_command
    from cann_llm.cli.export import export_command
    from cann_llm.cli.llm_commands import chat_command, generate_command
    from cann_llm.cli.serve import serve_command

    for command in (generate_command, chat_command, bench_command, serve_command, export_command):
        cli.add_command(command)


_add_llm_commands()


def main() -> None:
    """Console entry point."""
    main_with_codes(cli)


if __name__ == "__main__":
    main()
