"""onnxruntime session options for this process, with its optional process-wide thread pool.

A paged artifact runs as ~30 sessions taking turns. With a thread pool each, every turn wakes the next
session's sleeping worker; with one process-wide pool the workers stay warm across turns, and a step
comes closer to its bare matmul time (docs/performance.md#thread-pools). onnxruntime allows the shared pool
only if *every* session made afterwards in the process uses it, so all sessions here get their options from `session_options()`.
"""

from __future__ import annotations

import os

import onnxruntime as ort
from onnxruntime.capi import _pybind_state

_STATE: dict = {"process_pool": False, "arena": None}
# onnxruntime's arena grows in chunks of exactly what is asked for, not the next power of two
_SAME_AS_REQUESTED = 1


def enable_process_thread_pool(threads: int | None = None) -> bool:
    """Make the process-wide pool (once); False if this onnxruntime refuses. Sessions made before keep theirs.

    The pool's workers spin for tens of milliseconds after each run, and Python cannot switch that off for
    this pool, so between sessions they would hold cores the host kernels need and slow their attention
    (docs/performance.md#thread-pools). They are made SCHED_IDLE: they still run whenever a core is free, as it is during the
    sessions' own runs, and yield it to any other thread at once, this process's or another's (so on a
    machine loaded by other processes the sessions get fewer threads).
    """
    if not _STATE["process_pool"]:
        before = _thread_ids()
        try:
            _pybind_state.set_global_thread_pool_sizes(threads or os.cpu_count() or 1, 1)
            _STATE["process_pool"] = True
        except Exception as error:  # made already by someone else: it can be used, not replaced
            _STATE["process_pool"] = "already been created" in str(error)
        else:
            for worker in _thread_ids() - before:
                _yield_to_the_process(worker)
    return _STATE["process_pool"]


def _thread_ids() -> set[int]:
    tasks = "/proc/self/task"
    return {int(t) for t in os.listdir(tasks)} if os.path.isdir(tasks) else set()


def _yield_to_the_process(thread_id: int) -> None:
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # gone already, or not allowed here: it keeps the normal policy
            pass


def process_thread_pool_enabled() -> bool:
    return bool(_STATE["process_pool"])


def _shared_arena() -> bool:
    """Register one CPU arena for every session of the process (once); False if this onnxruntime refuses.

    Each session's own arena keeps the most it ever held: after a long prefill the ~30 sessions of a paged
    artifact would hold ~30 peaks at once (docs/performance.md#memory-at-run-time). Registered on first use,
    after the process-wide pool: registering creates onnxruntime's environment, which fixes the pool's
    settings."""
    if _STATE["arena"] is None:
        try:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, _SAME_AS_REQUESTED, -1, -1))
            _STATE["arena"] = True
        except Exception:  # noqa: BLE001 - an onnxruntime without shared allocators: sessions keep their own
            _STATE["arena"] = False
    return _STATE["arena"]


def session_options(threads: int | None = None) -> ort.SessionOptions:
    """Options on the process-wide pool when it exists (then `threads` is its size, not ours), else on a
    pool of `threads` (default: onnxruntime's); every session allocates from the one shared arena."""
    options = ort.SessionOptions()
    if _shared_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    # errors only as exceptions: a failing run raises with the same message onnxruntime would log
    options.log_severity_level = 4
    if _STATE["process_pool"]:
        options.use_per_session_threads = False
    elif threads:
        options.intra_op_num_threads = threads
    return options
