"""`cann-run serve`: the HTTP server (FastAPI on uvicorn) over one LLMEngine per model."""

from __future__ import annotations

import os

import click

from cli.common_options import shows_progress
from cli.llm_commands import engine_options_without_model, given
from runtime.errors import AtcError


def _models(values: tuple[str, ...]) -> dict[str, str]:
    models = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = os.path.splitext(os.path.basename(value))[0], value
        if not name or not path:
            raise AtcError("E10001", value, "--model", "expected NAME=path.om or path.om")
        if not os.path.isfile(path):
            raise AtcError("E13001", path, "No such file or directory")
        models[name] = path
    return models


@click.command("serve")
@click.option("--model", "-m", "model_specs", multiple=True, required=True,
              help="NAME=path.om (repeatable; the same file served twice is mapped once)")
@engine_options_without_model
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", "api_keys", multiple=True, help="accepted key (repeatable; or CANN_LLM_API_KEYS=a,b)")
@click.option("--quota-tokens", type=click.IntRange(min=1), default=None, help="tokens in+out allowed per key")
@click.option("--audit-log", default=None, help="append one JSON line per request here")
@click.option("--blocklist", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a file of terms (one a line) refused in prompts and cut from outputs")
@click.option("--max-pending", type=click.IntRange(min=1), default=256, show_default=True,
              help="requests admitted per model before 429")
@click.option("--request-timeout", type=click.FloatRange(min=0.1), default=300.0, show_default=True)
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="seconds in-flight requests get to finish on SIGTERM; the rest end with a 503")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 * 1024 * 1024, show_default=True,
              help="largest request body accepted; a larger one gets 413")
@click.option("--stats-interval", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="seconds between stats lines (running, waiting, tokens/s, KV pages); 0 is none")
@click.option("--metrics-prefix", default="cann_llm:", show_default=True,
              help="prefix of every metric's name (vllm: lets vLLM's dashboards read them as they are)")
@click.option("--max-memory", type=click.IntRange(min=1), default=None,
              help="MiB of resident memory: a request whose KV pages could take the process past it is refused "
                   "with 503 (default: no limit)")
@click.option("--breaker-threshold", type=click.IntRange(min=0), default=5, show_default=True,
              help="failed requests in a row after which a model sheds load (503) for --breaker-cooldown; 0: never")
@click.option("--breaker-cooldown", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="seconds a failing model sheds load before one request tries it again")
def serve_command(model_specs, host, port, api_keys, quota_tokens, audit_log, blocklist, max_pending, request_timeout,
                  shutdown_grace, max_body_bytes, stats_interval, metrics_prefix, max_memory, breaker_threshold,
                  breaker_cooldown, **engine_kwargs) -> None:
    """Serve /generate, OpenAI's /v1/completions and /v1/chat/completions (tools, structured outputs),
    vLLM's /tokenize and /detokenize, /health and /metrics."""
    from runtime.serving.guard import Guard
    from runtime.serving.lifecycle import serve
    from runtime.serving.server import Server, ServerSettings

    keys = list(api_keys) or [k for k in os.environ.get("CANN_LLM_API_KEYS", "").split(",") if k]
    guard = Guard(keys, quota_tokens, audit_log, blocklist)
    settings = ServerSettings(max_pending=max_pending, request_timeout_s=request_timeout, shutdown_grace_s=shutdown_grace,
                              max_body_bytes=max_body_bytes, metrics_prefix=metrics_prefix, max_memory_mb=max_memory,
                              breaker_threshold=breaker_threshold, breaker_cooldown_s=breaker_cooldown)
    # the server owns its process: the engines' sessions may share onnxruntime's process-wide pool
    server = Server(_models(model_specs), None, settings, guard,
                    engine_overrides={**given(engine_kwargs), "process_thread_pool": True})
    serve(server, host, port, stats_interval, _say)


def _say(line: str) -> None:
    """A line on stderr, unless `--log-level error` asked for errors only."""
    if shows_progress():
        click.echo(line, err=True)
