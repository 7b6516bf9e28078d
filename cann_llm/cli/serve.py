"""`cann-run serve`: the HTTP server (FastAPI on uvicorn) over one LLMEngine per model."""

from __future__ import annotations

import os

import click

from cann_llm.cli.common_options import EXISTING_FILE, shows_progress
from cann_llm.cli.llm_commands import engine_options_without_model, given
from cann_llm.runtime.errors import AtcError


def _models(values: tuple[str, ...]) -> dict[str, str]:
    models = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = os.path.splitext(os.path.basename(value))[0], value
        if not name or not path:
            raise AtcError("E10001", value, "--model", "expected NAME=path.om or path.om")
        if not os.path.isfile(path):
            raise AtcError("E13001", path, "the path is a directory" if os.path.isdir(path) else "No such file or directory")
        # one name, two artifacts: requests could reach only one of them
        if os.path.realpath(models.get(name, path)) != os.path.realpath(path):
            raise AtcError("E10001", value, "--model", f"the name {name!r} is given to {models[name]} already; "
                                                       f"name each model: NAME=path.om")
        models[name] = path
    return models


@click.command("serve")
@click.option("--model", "-m", "model_specs", multiple=True, required=True,
              help="NAME=path.om (repeatable; the same file served twice is mapped once)")
@engine_options_without_model
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (0.0.0.0: every IPv4 address; ::, every address, IPv6 and IPv4)")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", "api_keys", multiple=True, help="accepted key (repeatable; or CANN_LLM_API_KEYS=a,b)")
@click.option("--quota-tokens", type=click.IntRange(min=1), default=None, help="tokens in+out allowed per key")
@click.option("--audit-log", default=None, help="append one JSON line per request here")
@click.option("--blocklist", type=EXISTING_FILE, default=None,
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
@click.option("--access-log", is_flag=True, default=False,
              help="a line per request on stdout (uvicorn's: client, method, path, status)")
@click.option("--ray", "on_ray", is_flag=True, default=False,
              help="serve as a Ray Serve application: replicas behind one endpoint, prefix-aware routing "
                   "(docs/scale-out.md)")
@click.option("--ray-address", default=None,
              help="with --ray: a running cluster's address (auto: the one this machine joined); default: start "
                   "a local Ray instance")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --ray: engine replicas, each a process with its own KV cache")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="with --ray: let Ray Serve scale replicas between MIN and MAX on ongoing requests")
@click.option("--replica-cpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --ray: CPUs Ray reserves for each replica (its engine's threads unless --threads)")
@click.option("--router", type=click.Choice(["prefix", "pow2", "round_robin"]), default="prefix", show_default=True,
              help="with --ray: how a request's replica is chosen: by cached prefix, else the less loaded of two "
                   "(pow2, Ray Serve's default), or in turn")
def serve_command(model_specs, host, port, api_keys, quota_tokens, audit_log, blocklist, max_pending, request_timeout,
                  shutdown_grace, max_body_bytes, stats_interval, metrics_prefix, max_memory, breaker_threshold,
                  breaker_cooldown, access_log, on_ray, ray_address, replicas, autoscale, replica_cpus, router,
                  **engine_kwargs) -> None:
    """Serve /generate, OpenAI's /v1/completions and /v1/chat/completions (tools, structured outputs),
    vLLM's /tokenize and /detokenize, /health and /metrics; with --ray, as replicas on a Ray cluster."""
    from cann_llm.runtime.serving.server import ServerSettings

    keys = [k.strip() for k in api_keys] or [k.strip() for k in os.environ.get("CANN_LLM_API_KEYS", "").split(",")
                                              if k.strip()]
    if any(not key for key in keys):  # would be a key no client can present: every request refused
        raise AtcError("E10001", "''", "--api-key", "an API key must not be empty or blank")
    if quota_tokens is not None and not keys:
        raise AtcError("E10055", "--quota-tokens counts tokens per API key: give the keys with --api-key (or "
                                 "CANN_LLM_API_KEYS)")
    settings = ServerSettings(max_pending=max_pending, request_timeout_s=request_timeout, shutdown_grace_s=shutdown_grace,
                              max_body_bytes=max_body_bytes, metrics_prefix=metrics_prefix, max_memory_mb=max_memory,
                              breaker_threshold=breaker_threshold, breaker_cooldown_s=breaker_cooldown)
    if on_ray and access_log:
        raise AtcError("E10055", "--access-log is the single process's; with --ray, Ray Serve logs each request "
                                 "under /tmp/ray/session_latest/logs/serve")
    ray_only = {"--ray-address": ray_address is not None, "--replicas": replicas != 1, "--autoscale": autoscale is not None,
                "--replica-cpus": replica_cpus != 1, "--router": router != "prefix"}
    if not on_ray and any(ray_only.values()):
        raise AtcError("E10055", f"{next(f for f, on in ray_only.items() if on)} needs --ray")
    if on_ray:
        from cann_llm.runtime.serving.scale_out import Scaling

        _serve_on_ray(model_specs, host, port, keys, quota_tokens, audit_log, blocklist, settings, ray_address,
                      Scaling(replicas=replicas, cpus=replica_cpus, router=router), autoscale, given(engine_kwargs))
        return
    from cann_llm.runtime.serving.guard import Guard
    from cann_llm.runtime.serving.lifecycle import serve
    from cann_llm.runtime.serving.server import Server

    guard = Guard(keys, quota_tokens, audit_log, blocklist)
    # the server owns its process: the engines' sessions may share onnxruntime's process-wide pool
    server = Server(_models(model_specs), None, settings, guard,
                    engine_overrides={**given(engine_kwargs), "process_thread_pool": True})
    serve(server, host, port, stats_interval, _say, access_log)


def _serve_on_ray(model_specs, host, port, keys, quota_tokens, audit_log, blocklist, settings, address, scaling,
                  autoscale, engine_settings) -> None:
    from cann_llm.runtime.serving.ray_lifecycle import serve_on_ray
    from cann_llm.runtime.serving.scale_out import ReplicaSpec

    if quota_tokens is not None or audit_log is not None:
        # each replica would keep its own count and file: a key could spend its quota once per replica
        raise AtcError("E10055", "--quota-tokens and --audit-log are kept per process and cannot be used with --ray")
    if autoscale is not None:
        low, sep, high = autoscale.partition(":")
        if not (sep and low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
            raise AtcError("E10001", autoscale, "--autoscale", "expected MIN:MAX with 0 < MIN <= MAX")
        scaling.min_replicas, scaling.max_replicas = int(low), int(high)
    # paths as every node sees them: absolute
    models = {name: os.path.abspath(path) for name, path in _models(model_specs).items()}
    spec = ReplicaSpec(models, {"threads": scaling.cpus, **engine_settings}, settings, keys,
                       os.path.abspath(blocklist) if blocklist else None)
    serve_on_ray(spec, scaling, host, port, address, _say)


def _say(line: str) -> None:
    """A line on stderr, unless `--log-level error` asked for errors only."""
    if shows_progress():
        click.echo(line, err=True)
