"""The OpenAI-compatible service as a Ray Serve application: `EngineReplica`s, each a whole `Server` (engines,
admission, quotas of its own queue) answering through the same routes as `cann-run serve`, behind one
`Ingress` that reads each request's prompt, has the prefix-aware router (cann_llm/runtime/serving/prefix_router.py)
pick the replica, and streams the answer back. Ray runs the rest: placing replicas on nodes, their health
checks and restarts, autoscaling on ongoing requests.

A replica that dies under a request: if nothing of the answer was sent yet, the request is tried once more
on another replica; otherwise it ends with an error the client can retry on (503 in OpenAI's shape, or an
SSE `error` event and `[DONE]` in a stream). At shutdown the ingress drains before the application goes:
new requests and /health get 503 in OpenAI's shape, what is in flight has the grace period, and what is
still running then ends as a dead replica's answer does. `/metrics` sums the replicas' metrics
(cann_llm/runtime/serving/metrics_merge.py), `/metrics/replicas` keeps them apart, `/replicas` says which process
and node each replica is."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import ray
from prometheus_client.core import GaugeMetricFamily
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from cann_llm.runtime.serving.asgi_call import HttpCall, ResponseStart, run_asgi
from cann_llm.runtime.serving.metrics_merge import labelled, merged
from cann_llm.runtime.serving.scale_out import ReplicaSpec, Scaling
from cann_llm.runtime.serving.wire import error_body

_log = logging.getLogger(__name__)

APP_NAME = "cann-llm"
_BOARD = "cann-llm-metrics"       # the named actor the replicas report their metrics to
_NAMESPACE = "serve"
_PUSH_EVERY_S = 1.0               # a replica's metrics are at most this old (and fresher after each request)
_STALE_AFTER_S = 5.0              # a replica not heard from for this long is gone
_RETRYABLE = (RayActorError, ActorUnavailableError)
_SHUTTING_DOWN = "the server is shutting down"
_CUT_S = 10.0  # for the answers still running when the grace ends to end


class _Cut(Exception):
    """The drain's grace is over: the call in flight ends now."""


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The replicas' latest metrics, as each reported them."""

    def __init__(self):
        self.entries: dict[str, dict] = {}

    def put(self, replica: str, entry: dict) -> None:
        self.entries[replica] = {**entry, "at": time.monotonic()}

    def read(self) -> dict[str, dict]:
        """The replicas heard from recently, by replica id."""
        now = time.monotonic()
        return {r: {**e, "age_s": now - e["at"]} for r, e in self.entries.items() if now - e["at"] < _STALE_AFTER_S}


class _Reporter:
    """A replica's thread sending its metrics to the board: every `_PUSH_EVERY_S`, and soon after a request
    ends; the board is looked up again after a failed report (it is made by `cann-run serve --ray`, which
    may still be starting)."""

    def __init__(self, replica: str, describe):
        self.replica, self.describe = replica, describe
        self.poked, self.stopped = threading.Event(), threading.Event()
        self.board = None
        threading.Thread(target=self._run, name="metrics-reporter", daemon=True).start()

    def poke(self) -> None:
        self.poked.set()

    def stop(self) -> None:
        self.stopped.set()
        self.poked.set()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                if self.board is None:
                    self.board = ray.get_actor(_BOARD, namespace=_NAMESPACE)
                ray.get(self.board.put.remote(self.replica, self.describe()), timeout=5)
            except Exception:  # gone with the process that made it: looked up again next time
                self.board = None
            self.stopped.wait(0.1)  # bursts of requests report at most ten times a second
            self.poked.wait(_PUSH_EVERY_S)
            self.poked.clear()


@serve.deployment
class EngineReplica:
    """One `Server` and its engines in a Ray actor, answering forwarded calls through the HTTP routes."""

    def __init__(self, spec: ReplicaSpec):
        from prometheus_client import generate_latest

        from cann_llm.runtime.serving.guard import Guard
        from cann_llm.runtime.serving.routes import create_app
        from cann_llm.runtime.serving.server import Server

        self.server = Server(spec.models, None, spec.settings, Guard(spec.api_keys, None, None, spec.blocklist),
                             engine_overrides={**spec.engine_overrides, "process_thread_pool": True})
        self.server.load()
        if self.server.error:  # Ray Serve reports the deployment as failed, with this message
            raise RuntimeError(f"the models could not be loaded: {self.server.error}")
        self.app = create_app(self.server)
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        node = ray.get_runtime_context().get_node_id()

        def describe() -> dict:
            return {"pid": os.getpid(), "node": node, "status": self.server.status(),
                    "models": self.server.model_names(),
                    "metrics": generate_latest(self.server.metrics.registry).decode()}

        self.reporter = _Reporter(self.replica, describe)

    async def handle(self, call: HttpCall):
        """The call's ResponseStart, then its body's pieces."""
        try:
            async for piece in run_asgi(self.app, call):
                yield piece
        finally:
            self.reporter.poke()

    def check_health(self) -> None:
        status = self.server.status()
        if status != "ok":
            raise RuntimeError(f"the server is {status}")

    def __del__(self):
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Ingress:
    """The HTTP face of the deployment: forwards each request to a replica and streams back its answer."""

    def __init__(self, replicas: DeploymentHandle, metrics_prefix: str, max_body_bytes: int, retry_after_s: int):
        self.replicas = replicas.options(stream=True)
        self.prefix, self.max_body_bytes, self.retry_after_s = metrics_prefix, max_body_bytes, retry_after_s
        self.board = metrics_board()
        self.draining = False
        self.cut = asyncio.Event()  # the drain's grace is over
        self.open = 0  # forwarded calls whose answer is not all out

    async def drain(self, grace_s: float) -> None:
        """Refuse what comes from now on (503), give the calls in flight `grace_s` to finish, then end the rest
        (`stop_waiting` ends the grace sooner); returns once none is left."""
        self.draining = True
        try:
            await asyncio.wait_for(self._all_out(), grace_s)
        except asyncio.TimeoutError:
            pass
        self.cut.set()
        try:  # bounded: a call whose client left before its answer began is never counted out
            await asyncio.wait_for(self._all_out(), _CUT_S)
        except asyncio.TimeoutError:
            pass

    async def stop_waiting(self) -> None:
        """End the drain's grace now (async: the event belongs to this replica's loop)."""
        self.cut.set()

    async def _all_out(self) -> None:
        while self.open:
            await asyncio.sleep(0.05)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if self.draining:
            if path == "/health":
                return JSONResponse({"status": "shutting down"}, status_code=503,
                                    headers={"Retry-After": str(self.retry_after_s)})
            return _error(503, _SHUTTING_DOWN, "unavailable", retry_after_s=self.retry_after_s)
        if request.method == "GET" and path in ("/metrics", "/metrics/replicas", "/replicas", "/health"):
            return await self._about_replicas(path)
        self.open += 1  # from here on the call has the drain's grace, its body still arriving included
        response = None
        try:
            response = await self._forward_request(request)
            return response
        finally:
            if not isinstance(response, StreamingResponse):  # a streamed answer is out when `_rest` ends
                self.open -= 1

    async def _forward_request(self, request: Request) -> Response:
        declared = request.headers.get("content-length", "")
        too_large = _error(413, f"the request body is larger than {self.max_body_bytes} bytes", "invalid_request_error")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return too_large
        body = await request.body()
        if len(body) > self.max_body_bytes:
            return too_large
        return await self._forward(HttpCall.of(request.method, request.url.path, request.scope.get("query_string", b""),
                                               list(request.scope.get("headers", [])), body))

    async def _forward(self, call: HttpCall) -> Response:
        """Send `call` to a replica; tried once more elsewhere when the replica died before any of its answer
        was sent."""
        for attempt in (1, 2):
            stream = self.replicas.handle.remote(call)
            try:
                start: ResponseStart = await self._unless_cut(stream.__anext__)
                first = await self._unless_cut(lambda: anext(stream, b""))
            except BackPressureError:
                return _error(429, "the server is at capacity; retry shortly", "rate_limit_exceeded", retry_after_s=1)
            except _Cut:
                stream.cancel()
                return _error(503, _SHUTTING_DOWN, "unavailable", retry_after_s=self.retry_after_s)
            except _RETRYABLE as error:
                stream.cancel()
                _log.warning("replica failed before answering (attempt %d): %s", attempt, error)
                continue
            response = StreamingResponse(self._rest(first, stream, start), status_code=start.status)
            retried = [(b"x-replica-retried", b"1")] if attempt > 1 else []
            response.raw_headers = [h for h in start.headers if h[0].lower() != b"content-length"] + retried
            return response
        return _error(503, "the replica serving this request failed twice; retry", "unavailable", retry_after_s=1)

    async def _unless_cut(self, step):
        """What `step()` gives, awaited, unless the drain's grace ends first (_Cut)."""
        if self.cut.is_set():
            raise _Cut
        task, cut = asyncio.ensure_future(step()), asyncio.ensure_future(self.cut.wait())
        try:
            done, _ = await asyncio.wait((task, cut), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this caller is cancelled (its client gone): no task is left behind
            cut.cancel()
            if not task.done():
                task.cancel()
        if task not in done:
            raise _Cut
        return task.result()

    async def _rest(self, first: bytes, stream, start: ResponseStart):
        finished = False
        streamed = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
        try:
            yield first
            piece = first
            try:
                while True:
                    try:
                        piece = await self._unless_cut(stream.__anext__)
                    except StopAsyncIteration:
                        break
                    yield piece
            except (*_RETRYABLE, _Cut) as error:  # part of the answer is out: the client has to retry it
                if isinstance(error, _Cut):
                    stream.cancel()
                if streamed and not piece.endswith(b"data: [DONE]\n\n"):  # unless all of it is out
                    why = _SHUTTING_DOWN if isinstance(error, _Cut) else \
                        "the replica serving this request failed mid-answer; retry"
                    yield f"data: {json.dumps(error_body(503, why, 'unavailable'))}\n\ndata: [DONE]\n\n".encode()
            finished = True
        finally:
            self.open -= 1
            if not finished:  # the client went away: the replica stops generating
                stream.cancel()

    async def _about_replicas(self, path: str) -> Response:
        entries = await self.board.read.remote()
        if path == "/replicas":
            return JSONResponse({"replicas": [{"replica": r, "pid": e["pid"], "node": e["node"], "status": e["status"],
                                               "models": e["models"], "reported_s_ago": round(e["age_s"], 3)}
                                              for r, e in sorted(entries.items())]})
        if path == "/health":
            serving = [e for e in entries.values() if e["status"] == "ok"]
            if not serving:
                return JSONResponse({"status": "loading", "replicas": 0}, status_code=503)
            return JSONResponse({"status": "ok", "replicas": len(serving), "models": serving[0]["models"]})
        texts = {r: e["metrics"] for r, e in sorted(entries.items())}
        if path == "/metrics/replicas":
            return PlainTextResponse(labelled(texts))
        count = GaugeMetricFamily(self.prefix + "replicas", "Replicas that reported their metrics in the last "
                                                            f"{_STALE_AFTER_S:g} s", value=len(texts))
        return PlainTextResponse(merged(list(texts.values()), [count]))


def metrics_board():
    """The board the replicas report to (made by the first to ask: `cann-run serve --ray`, so it lives as
    long as that process)."""
    return MetricsBoard.options(name=_BOARD, namespace=_NAMESPACE, get_if_exists=True).remote()


def serving_replicas(board) -> int:
    """How many replicas reported recently that they serve."""
    return sum(entry["status"] == "ok" for entry in ray.get(board.read.remote()).values())


def _error(status: int, message: str, kind: str, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def build_app(spec: ReplicaSpec, scaling: Scaling):
    """The application to `serve.run`."""
    options = scaling.deployment_options(spec.settings.max_pending, len(set(spec.models.values())),
                                         target_ongoing=spec.engine_overrides.get("max_batch_size", 8))
    replicas = EngineReplica.options(**options, graceful_shutdown_timeout_s=spec.settings.shutdown_grace_s).bind(spec)
    ingress = Ingress.options(max_ongoing_requests=scaling.most * spec.settings.max_pending + 64)
    return ingress.bind(replicas, spec.settings.metrics_prefix, spec.settings.max_body_bytes, spec.settings.retry_after_s)
