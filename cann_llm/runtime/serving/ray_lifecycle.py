"""`cann-run serve --ray` as a process: join a Ray cluster (or start a local one), run the application
(cann_llm/runtime/serving/ray_app.py) with Ray Serve's HTTP proxy on HOST:PORT, say when it is ready, and on SIGTERM
or SIGINT delete it (Ray Serve lets each replica's requests finish within the grace period) and leave."""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ray_import import require_ray


def serve_on_ray(spec, scaling, host: str, port: int, address: str | None, say: Callable[[str], None]) -> None:
    """Serve `spec` (a ReplicaSpec) scaled as `scaling` until a signal. `address`: a running cluster's
    (`auto` finds the one this machine belongs to); None starts a local Ray instance for this process.
    AtcError E10001 when HOST:PORT is taken or the cluster cannot be reached, E13017 when the deployment
    fails (a replica cannot load its models, or the cluster lacks the CPUs asked for)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        # Ray's token authentication, as a local `ray.init()` has it, with a token of this cluster's own passed
        # to the head and read by this process (Ray reads both variables when imported); the user's wins
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if os.environ["RAY_AUTH_MODE"] == "token" and not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(os.environ):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    ray = require_ray()
    from ray import serve

    from cann_llm.runtime.serving.ray_app import APP_NAME, build_app, metrics_board, serving_replicas

    port = _free(host, port)
    began = time.perf_counter()
    head = None
    if address is None:
        say("starting a local Ray head node …")
        head, address = _start_head()
    else:
        say(f"joining the Ray cluster at {address} …")
    where = address
    try:
        _connect(ray, address, head)
    except BaseException:
        _stop_head(head)
        raise
    stop, again = threading.Event(), threading.Event()  # a signal; a second one

    def signalled(*_) -> None:
        (again if stop.is_set() else stop).set()

    for number in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(number, signalled)
    deployed = False
    try:
        _check_capacity(ray, where, scaling)
        _start_serve(ray, serve, {"host": host, "port": port})
        if APP_NAME in serve.status().applications:
            raise AtcError("E10055", f"an application named {APP_NAME!r} already runs on the cluster at {where}; "
                                     f"one deployment per cluster")
        count = (f"{scaling.min_replicas}-{scaling.max_replicas} replicas (autoscaled)" if scaling.max_replicas
                 else f"{scaling.replicas} replica{'s' if scaling.replicas != 1 else ''}")
        say(f"deploying {count} of {', '.join(spec.models)}, {scaling.cpus:g} CPU each …")
        board = metrics_board()
        deployed = True
        if not _deploy(serve, build_app(spec, scaling), APP_NAME, stop, where):
            return  # told to stop while deploying
        # ready when /health says so: every replica Ray started has reported that it serves
        deadline = time.monotonic() + _REPORT_TIMEOUT_S
        while serving_replicas(board) < (scaling.min_replicas or scaling.replicas):
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                raise AtcError("E13017", where, f"the replicas were deployed but did not report that they serve "
                                                f"within {_REPORT_TIMEOUT_S} s")
            time.sleep(0.1)
        shown = f"[{host}]" if ":" in host else host
        say(f"ready in {time.perf_counter() - began:.1f} s: http://{shown}:{port} (models: {', '.join(spec.models)}; "
            f"{count} on Ray; /replicas lists them)")
        while not stop.wait(0.5):
            pass
        say("shutting down: in-flight requests get the grace period …")
    finally:
        try:
            if deployed:
                try:
                    _drain(serve, APP_NAME, spec.settings.shutdown_grace_s, again)
                except Exception as error:  # the ingress died: the application goes all the same
                    say(f"the drain failed ({_first_line(error)}); stopping")
                serve.delete(APP_NAME)
            if head is not None:  # the cluster is this process's own: Serve goes with it
                serve.shutdown()
        finally:
            ray.shutdown()
            _stop_head(head)


_DEPLOY_TIMEOUT_S = 900   # loading a large model on every replica takes minutes; placing them should not
_REPORT_TIMEOUT_S = 60
_CUT_TIMEOUT_S = 30       # for the answers still running when the grace ends to be ended


def _drain(serve, name: str, grace_s: float, again: threading.Event) -> None:
    """Have the application's ingress drain (cann_llm/runtime/serving/ray_app.py: refuse new requests, give those in
    flight `grace_s`, end the rest), its routes kept meanwhile; `again` (a second signal) ends the grace."""
    application = serve.status().applications.get(name)
    # the ingress (one replica) serves once it is healthy, whatever the engine replicas are doing (scaling,
    # one of them restarting); before that, nothing was answered: nothing to drain
    ingress_status = application.deployments.get("Ingress") if application is not None else None
    if ingress_status is None or ingress_status.status != "HEALTHY":
        return
    ingress = serve.get_app_handle(name)
    drained = ingress.drain.remote(grace_s)
    deadline = time.monotonic() + grace_s + _CUT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            drained.result(timeout_s=0.25)
            return
        except TimeoutError:
            if again.is_set():
                again.clear()
                ingress.stop_waiting.remote()
                deadline = min(deadline, time.monotonic() + _CUT_TIMEOUT_S)


def _start_serve(ray, serve, http_options: dict, attempts: int = 3) -> None:
    """`serve.start`, again when its HTTP proxy died starting: Serve's controller kills a proxy that is not
    ready within 5 s (a busy machine's imports can take longer) and starts another, with more time."""
    for attempt in range(attempts):
        try:
            serve.start(http_options=http_options)
            return
        except ray.exceptions.ActorDiedError:
            if attempt == attempts - 1:
                raise


def _check_capacity(ray, where: str, scaling) -> None:
    """Refuse replicas the cluster has not the CPUs for: Ray would wait for them for ever."""
    total = ray.cluster_resources().get("CPU", 0)
    least = (scaling.min_replicas or scaling.replicas) * scaling.cpus
    if least > total:
        raise AtcError("E13017", where, f"{scaling.min_replicas or scaling.replicas} replicas of {scaling.cpus:g} "
                                        f"CPU need {least:g} CPUs; the cluster has {total:g}")


def _deploy(serve, app, name: str, stop: threading.Event, where: str) -> bool:
    """`serve.run` on a thread of its own, so that a signal or the deadline can end the wait: True once the
    application runs, False when told to stop; AtcError E13017 when it fails or does not come up in time."""
    outcome: list = []

    def run() -> None:
        try:
            serve.run(app, name=name, route_prefix="/")
            outcome.append(None)
        except Exception as error:  # Ray Serve's report of the replicas' failure
            outcome.append(error)

    thread = threading.Thread(target=run, name="serve-run", daemon=True)
    thread.start()
    deadline = time.monotonic() + _DEPLOY_TIMEOUT_S
    while thread.is_alive():
        if stop.is_set():
            return False
        if time.monotonic() > deadline:
            raise AtcError("E13017", where, f"the replicas were not placed and loaded within {_DEPLOY_TIMEOUT_S} s "
                                            f"(ray status shows what the cluster has)")
        thread.join(0.25)
    if outcome and outcome[0] is not None:
        raise AtcError("E13017", where, _first_line(outcome[0]))
    return True


def _start_head() -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` in a session of its own, so a Ctrl-C or a signal to this process group
    reaches this process alone and the replicas are shut down in order; (the process, the cluster's address)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        gcs_port = probe.getsockname()[1]
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={gcs_port}",
               "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"]
    log = tempfile.TemporaryFile()  # read only if it fails to start; a pipe left unread could fill and block it
    head = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                            preexec_fn=_terminated_with_parent)
    head.stderr_log = log
    return head, f"127.0.0.1:{gcs_port}"


def _terminated_with_parent() -> None:
    """In the head's process before it runs: SIGTERM when this process dies, however it dies (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _connect(ray, address: str, head: subprocess.Popen | None, timeout_s: float = 120.0) -> None:
    """Join the cluster at `address`; a head node this process started is waited for first (a failed
    `ray.init` leaves state behind that fails the attempts after it)."""
    if head is not None:
        _wait_for_head(head, address, timeout_s)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise AtcError("E10001", address, "--ray-address", f"no Ray cluster answers there: {error}") from None


def _wait_for_head(head: subprocess.Popen, address: str, timeout_s: float) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            head.stderr_log.seek(0)
            why = head.stderr_log.read().decode(errors="replace").strip().splitlines()[-1:] or ["it exited"]
            raise AtcError("E13017", address, f"the local Ray head did not start: {why[0]}")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AtcError("E13017", address, f"the local Ray head did not start in {timeout_s:g} s") from None
            time.sleep(0.25)


def _stop_head(head: subprocess.Popen | None) -> None:
    if head is None or head.poll() is not None:
        return
    head.terminate()  # `ray start --block` stops the node's processes on SIGTERM
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()


def _free(host: str, port: int) -> int:
    """`port`, checked to be free on `host` (0: one the system picks)."""
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            return probe.getsockname()[1]
    except OSError as error:
        raise AtcError("E10001", f"{host}:{port}", "--host/--port", error.strerror or str(error)) from None


def _first_line(error: Exception) -> str:
    """The part of Ray's report that says why: its last line naming an error, without the traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line and not line.startswith(("File ", "Traceback"))]
    return (said[-1] if said else lines[0] if lines else type(error).__name__)[:500]
