"""`cann-run generate` and `cann-run chat`: text generation with the LLMEngine from the command line."""

from __future__ import annotations

import sys
from dataclasses import fields
from functools import wraps

import click
from click.core import ParameterSource
from jinja2.exceptions import TemplateError

from cann_llm.cli.common_options import EXISTING_FILE, shows_progress
from cann_llm.cli.json_output import write_json
from cann_llm.cli.loading import loading
from cann_llm.cli.text_inputs import checked_text, shown
from cann_llm.runtime.chat_template import compile_template
from cann_llm.runtime.conversation import COMPACTIONS, Conversation, ConversationSettings
from cann_llm.runtime.long_context import SCORINGS, LongContext
from cann_llm.runtime.engine.config import EngineConfig
from cann_llm.runtime.engine.engine import GenerationFailed
from cann_llm.runtime.engine.sampling import MIN_TEMPERATURE, PENALTY_RANGE, SamplingParams
from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.safe_files import read_text


def _engine_option(item):
    """The option decorator of one `EngineConfig` field: the field's default, help, bounds or choices."""
    meta = item.metadata
    if "choices" in meta:
        kind = click.Choice(meta["choices"])
    elif meta.get("path"):
        kind = EXISTING_FILE
    elif item.type in (bool, "bool"):
        return click.option(f"--{item.name}/--no_{item.name}", default=item.default, show_default=True, help=meta["help"])
    else:
        kind = click.IntRange(min=meta.get("min"))
    return click.option(f"--{item.name}", type=kind, default=item.default, show_default=item.default is not None,
                        help=meta["help"])


_ENGINE_OPTIONS = [_engine_option(item) for item in fields(EngineConfig) if item.metadata.get("cli", True)]


def engine_options_without_model(command):
    """The LLMEngine's settings as options (serve names its models its own way)."""
    return _with(_ENGINE_OPTIONS, command)


def engine_options(command):
    """--model and the LLMEngine's settings, shared by generate, chat and bench."""
    command = engine_options_without_model(command)
    return click.option("--model", "-m", required=True, help="the .om to run (paged or contiguous KV cache)")(command)


_SAMPLING_OPTIONS = [
    click.option("--max_new_tokens", type=click.IntRange(min=1), default=128, show_default=True),
    # no click range: 0, then a gap up to MIN_TEMPERATURE, which SamplingParams refuses naming the flag
    click.option("--temperature", type=float, default=0.7, show_default=True,
                 help=f"0 is greedy; otherwise at least {MIN_TEMPERATURE:g}"),
    click.option("--top_p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True),
    click.option("--top_k", type=click.IntRange(min=0), default=0, show_default=True),
    click.option("--repetition_penalty", type=click.FloatRange(*PENALTY_RANGE), default=1.0, show_default=True),
    click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None),
    click.option("--stop", multiple=True, help="stop string (repeatable)"),
]


def _with(options, command):
    for option in reversed(options):
        command = option(command)
    return command


def sampling_options(command):
    """Per-request sampling settings."""
    return _with(_SAMPLING_OPTIONS, command)


def given(settings: dict) -> dict:
    """The settings given on the command line: one left at its default lets the artifact's tuned value
    (`atc --auto_tune_mode`, cann_llm/runtime/engine/tuning.py) apply, and the defaults are EngineConfig's anyway."""
    context = click.get_current_context(silent=True)
    if context is None:
        return settings
    return {name: value for name, value in settings.items()
            if context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)}


def open_engine(model, forced: dict | None = None, **settings):
    """An LLMEngine from the shared options (`EngineConfig`'s fields) and the settings a command itself
    requires (`forced`, which win); AtcError for a file that is not a runnable artifact. The settings are
    checked before the model loads, which takes seconds."""
    from cann_llm.runtime.engine.engine import LLMEngine

    overrides = {**given(settings), **(forced or {})}
    EngineConfig(**overrides)  # its ValueError names the setting
    template_file = overrides.get("chat_template_file")
    if template_file is not None:
        try:
            compile_template(read_text(template_file))
        except TemplateError as error:
            raise invalid_value(template_file, "chat_template_file", f"It is not a jinja template: {error}.") from None
    # the command owns its process, so the engine's sessions may share onnxruntime's process-wide pool
    with loading(model):
        return LLMEngine(model, **overrides, process_thread_pool=True)


def _sampling(kwargs: dict) -> SamplingParams:
    """The sampling options taken out of `kwargs`, checked before the model loads."""
    keys = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop")
    return SamplingParams(**{key: kwargs.pop(key) for key in keys})


def refused(error: ValueError, flag: str, value) -> AtcError:
    """E10001 for what the engine or a setting refused, naming the option of the setting it is about, else
    `flag` (as printed: `--prompt`, `stdin`) with `value`: the prompt's or the turn's own flag for the prompt."""
    options = click.get_current_context().params
    # a model without a tokenizer cannot take a text prompt: the model is the one to change
    setting = getattr(error, "setting", None)
    named = "model" if setting == "tokenizer" else setting
    if named == "prompt" and options.get("prompt_ids") is not None:  # the prompt came as token ids
        named = "prompt_ids"
    if named in options:
        flag, value = f"--{named}", options[named]
    return AtcError("E10001", shown(value), flag, str(error))


def _value_errors_as_codes(fn):
    @wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as error:
            raise refused(error, "--prompt", kwargs.get("prompt", "request")) from None
        except GenerationFailed as error:  # a fault inside the engine's step: ours, not the request's
            raise AtcError("E19999", reason=str(error)) from None
    return run


def _stream(engine, prompt, params: SamplingParams, out):
    request = engine.submit(prompt, params)
    if engine.tokenizer is None:  # ids, not text: printed once they are all there
        request.result()
        out.write(" ".join(map(str, request.output_ids)))
        return request
    for piece in request.iter_text():
        out.write(piece)
        out.flush()
    request.result()
    return request


def _prompt_ids(prompt: str | None, prompt_ids: str | None, chat_template: bool,
                context_file: str | None) -> list[int] | None:
    """--prompt_ids as a list (None when --prompt is given); E10001 unless exactly one of the two is, or
    for ids with what only text takes."""
    if (prompt is None) == (prompt_ids is None):
        raise invalid_value(prompt_ids if prompt is not None else "(none)", "prompt_ids",
                            "Give either --prompt (text) or --prompt_ids (token ids), one of them.")
    if prompt_ids is None:
        return None
    for flag, given in (("--chat_template", chat_template), ("--context_file", context_file)):
        if given:
            raise invalid_value(prompt_ids, "prompt_ids", f"{flag} takes text: use --prompt with it.")
    words = prompt_ids.replace(",", " ").split()
    if not words or not all(word.isascii() and word.isdigit() for word in words):
        raise invalid_value(prompt_ids, "prompt_ids", "Give token ids as non-negative integers, \"1,2,3\".")
    return [int(word) for word in words]


def _info(line: str) -> None:
    """An `[INFO]` line on stderr, unless `--log-level error` asked for errors only."""
    if shows_progress():
        click.echo(line, err=True)


def _stats_line(request) -> str:
    stats = request.stats
    rate = (stats.output_tokens - 1) / (stats.total_s - stats.ttft_s) if stats.tpot_s else 0.0
    return (f"[INFO] prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} from the prefix cache), "
            f"{stats.output_tokens} generated ({request.finish_reason}); TTFT {stats.ttft_s * 1e3:.1f} ms, "
            f"decode {rate:.1f} tokens/s")


@click.command("generate")
@engine_options
@sampling_options
@click.option("--prompt", "-p", default=None, help="the text to continue")
@click.option("--prompt_ids", default=None,
              help="token ids to continue instead of text, \"1,2,3\" (what a model compiled without a tokenizer "
                   "takes; such a model prints the ids it generates, one with a tokenizer their text)")
@click.option("--chat_template/--no_chat_template", default=False, show_default=True,
              help="wrap the prompt as one user message in the model's chat template")
@click.option("--json", "json_path", default=None,
              help="write the text and the request's stats here; - is stdout (the text then streams to stderr)")
@click.option("--context_file", type=EXISTING_FILE, default=None,
              help="a document to answer --prompt from: its passages most relevant to the question (BM25) that "
                   "fit the context are given to the model with it, through the chat template")
@click.option("--context_scoring", type=click.Choice(SCORINGS), default="bm25", show_default=True,
              help="how --context_file's passages are ranked: BM25, or hybrid (BM25 fused with the model's own "
                   "token embeddings, for questions worded unlike the document)")
@_value_errors_as_codes
def generate_command(prompt, prompt_ids, chat_template, json_path, context_file, context_scoring, **kwargs) -> None:
    """Generate a continuation of --prompt (or of the token ids --prompt_ids), streamed to stdout (or, with
    --context_file, an answer to it from the document)."""
    params = _sampling(kwargs)
    ids = _prompt_ids(prompt, prompt_ids, chat_template, context_file)
    document = read_text(context_file) if context_file else None  # before the model loads: a bad file fails at once
    with open_engine(**kwargs) as engine:
        if ids is not None:
            text = ids
        elif document is not None:
            long_context = LongContext(engine.tokenizer, scoring=context_scoring, embed=engine.embed_tokens)
            text, selection = long_context.prompt(engine, document, prompt, params.max_new_tokens)
            _info(f"[INFO] context: {len(selection.chunks)} passages, {selection.tokens} of the document's "
                  f"{selection.document_tokens} tokens")
        else:
            text = engine.chat_prompt([{"role": "user", "content": checked_text(prompt, "--prompt")}]) \
                if chat_template else prompt
        out = sys.stderr if json_path == "-" else sys.stdout  # stdout is the JSON's alone then
        request = _stream(engine, text, params, out)
    click.echo(file=out)
    _info(_stats_line(request))
    if json_path:
        stats = request.stats
        write_json(json_path, {
            "text": request.text, "finish_reason": request.finish_reason, "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens, "output_tokens": stats.output_tokens, "ttft_s": stats.ttft_s,
            "total_s": stats.total_s, "output_ids": request.output_ids})


@click.command("chat")
@engine_options
@sampling_options
@click.option("--system", default=None, help="a system message opening the conversation")
@click.option("--message", multiple=True, help="user turns to send in order instead of reading stdin (repeatable)")
@click.option("--context_budget", type=click.IntRange(min=2), default=None,
              help="tokens a turn's prompt and reply may take [default: max_context_len]")
@click.option("--compaction", type=click.Choice(COMPACTIONS), default="summarize", show_default=True,
              help="what happens to the earliest turns when the next would not fit: summarised by the model, or dropped")
@_value_errors_as_codes
def chat_command(system, message, context_budget, compaction, **kwargs) -> None:
    """Talk with the model; each turn reuses the conversation so far through the prefix cache.

    Reads one user turn per line from stdin (or takes --message turns); an empty line, `/exit` or end of
    input ends the conversation. When the next turn would not fit the context budget, the earliest turns
    are summarised by the model (or dropped) and a line says so.
    """
    params = _sampling(kwargs)
    system = None if system is None else checked_text(system, "--system")
    for turn in message:
        if not checked_text(turn, "--message").strip():
            raise invalid_value(repr(turn), "message", "A turn is empty: give text, or leave the turn out.")
    interactive = not message and sys.stdin.isatty()
    source = "--message" if message else "stdin"
    turns = iter(message) if message else _stdin_turns()
    with open_engine(**kwargs) as engine:
        conversation = Conversation(engine, ConversationSettings(context_budget, compaction), system)
        while True:
            if interactive:
                click.echo("user> ", nl=False)
            turn = next(turns, None)
            if turn is None or not turn.strip() or turn.strip() == "/exit":
                break
            if not interactive:
                click.echo(f"user> {turn}")
            try:
                prompt = conversation.prompt(turn, params.max_new_tokens)
                for compacted in conversation.compactions:
                    _info(_compaction_line(engine, compacted))
                click.echo("assistant> ", nl=False)
                request = _stream(engine, prompt, params, sys.stdout)
            except ValueError as error:  # the turn, or the pool's size for it
                raise refused(error, source, turn) from None
            click.echo()
            _info(_stats_line(request))
            conversation.reply(request.text)


def _stdin_turns():
    """stdin's lines, each refused (E10001) unless it is UTF-8."""
    try:
        for line in sys.stdin:
            yield checked_text(line.rstrip("\n"), "stdin")
    except UnicodeDecodeError as error:
        raise AtcError("E10001", "a line", "stdin", f"It is not UTF-8 text: {error}.") from None


def _compaction_line(engine, compacted) -> str:
    if compacted.summary is None:
        what = f"dropped the {compacted.messages} earliest messages" if compacted.messages else "dropped the summary"
    else:
        tokens = len(engine.tokenizer.encode(compacted.summary, add_special_tokens=False))
        what = f"summarised the {compacted.messages} earliest messages in {tokens} tokens"
    return f"[INFO] the conversation outgrew its budget: {what}"
