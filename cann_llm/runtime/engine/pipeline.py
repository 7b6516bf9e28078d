"""Pipeline-parallel execution of a model compiled with `atc --pipeline_stages=K`: each stage artifact (a
contiguous range of layers, cann_llm/passes/pipeline_stages.py) runs in a Ray actor of its own, holding its weights
and the KV pages of its layers; the engine's process holds none of them, only the scheduler, the block
manager and the sampler.

A step's batch is cut into micro-batches (one per stage, by tokens); each is sent down the chain of
stages as soon as it is built, the hidden states passed from actor to actor through Ray's object store.
An actor runs its tasks in the order they were sent, so while stage 2 computes micro-batch 1, stage 1
computes micro-batch 2: the stages overlap. Every stage is given the same page tables, so one block
manager addresses the K pools; page copies (prefix caching) go to every stage.

Ray rather than torch.distributed or MPI: its actors start and stop from Python without a launcher,
place themselves on whichever node of a cluster has the CPUs, pass numpy arrays without copies on one
node, and are the same engine `cann-run serve --ray` deploys replicas on (docs/scale-out.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cann_llm.runtime.engine.runner import PagedRunner
from cann_llm.runtime.engine.scheduler import ScheduledBatch
from cann_llm.runtime.engine.state_pool import StatePool
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.ray_import import require_ray

HIDDEN_IN = "hidden_states"
_LOAD_TIMEOUT_S = 600


class StageWorker:
    """One stage in its process: its executor and the KV pages of its layers."""

    def __init__(self, path: str, num_pages: int, backend: str, threads: int | None, native_matmul: bool):
        from cann_llm.runtime.engine.kv_cache import PagePool
        from cann_llm.runtime.executor import Executor
        from cann_llm.runtime.heap_trim import release_free_heap
        from cann_llm.runtime.loader import load_artifact
        from cann_llm.runtime.ort_session import enable_process_thread_pool

        loaded = load_artifact(path, tokenizer=False)
        dims = loaded.metadata["model"]
        if backend == "onnxruntime":
            enable_process_thread_pool(threads)  # the actor's process is the stage's alone
        self.executor = Executor(loaded, backend, threads, native_matmul=native_matmul)
        self.pool = PagePool.of(dims, num_pages, loaded.kv_cache["page_size"])
        self.output = loaded.output_names[0]
        self.inputs = set(loaded.input_names)
        release_free_heap()

    def run(self, feeds: dict[str, np.ndarray], hidden: np.ndarray | None = None) -> np.ndarray:
        """This stage's output for one micro-batch: the next stage's hidden states, or the logits."""
        # every stage is sent the batch's metadata; each takes what its own graph reads
        feeds = {name: value for name, value in feeds.items() if name in self.inputs}
        if hidden is not None:
            feeds[HIDDEN_IN] = hidden
        return self.executor.run(feeds, [self.output], kv_cache=self.pool)[self.output]

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        self.pool.copy(copies)

    def process(self) -> dict:
        """Where it runs: its process id, and its resident bytes now and at their peak (Linux)."""
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return {"pid": os.getpid(), "resident_bytes": int(fields["VmRSS"].split()[0]) * 1024,
                "peak_resident_bytes": int(fields["VmHWM"].split()[0]) * 1024}


class _Pages:
    """What the trial step reads of a pool that lives in the stages."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages


class PipelinedRunner(PagedRunner):
    """A PagedRunner whose graph runs as the chain of stage actors; Ray is started when not running
    (`RAY_ADDRESS` joins a cluster)."""

    def __init__(self, paths: list[Path], num_pages: int, page_size: int, backend: str, threads: int | None,
                 native_matmul: bool, last_positions: bool = False):
        ray = require_ray()
        if not ray.is_initialized():
            # "local" starts an instance of this process's own: a bare ray.init() would join whatever cluster
            # last ran on this machine (/tmp/ray/ray_current_cluster), even one that has stopped
            address = os.environ.get("RAY_ADDRESS") or "local"
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as error:
                raise AtcError("E10001", address, "RAY_ADDRESS", f"no Ray cluster answers there: {error}") from None
        worker = ray.remote(StageWorker)
        self.executor, self.pool, self.page_size = None, _Pages(num_pages), page_size
        self.last_positions = last_positions  # the stages all read the feeds the first one does
        self.states = StatePool({"inputs": []})  # none: --pipeline_stages refuses a hybrid's states
        # each stage asks for its threads' CPUs, or its share of a cluster too small for that (a stage waits
        # on its neighbours much of the time): asking for more than the cluster has would wait for ever
        cpus = min(threads or 1, ray.cluster_resources().get("CPU", 1) / len(paths))
        self.stages = [worker.options(num_cpus=cpus).remote(str(path), num_pages, backend, threads, native_matmul)
                       for path in paths]
        self._ray = ray
        try:
            self.processes = ray.get([stage.process.remote() for stage in self.stages], timeout=_LOAD_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise AtcError("E13017", ray.get_runtime_context().gcs_address,
                           f"the {len(paths)} pipeline stages were not all placed and loaded in "
                           f"{_LOAD_TIMEOUT_S} s") from None
        except ray.exceptions.RayActorError as error:  # a stage failed to load: its own error says why
            self.close()
            cause = error.__cause__ or error
            if isinstance(cause, AtcError):
                raise cause from None
            raise AtcError("E13017", ray.get_runtime_context().gcs_address, str(cause).splitlines()[-1]) from None

    def run(self, batch: ScheduledBatch) -> np.ndarray:
        ends = []
        for part in micro_batches(batch, len(self.stages)):
            feeds = self.feeds(part)
            carried = None
            for stage in self.stages:
                carried = stage.run.remote(feeds, carried)
            ends.append(carried)
        try:
            return np.concatenate(self._ray.get(ends))
        except self._ray.exceptions.RayActorError as error:  # the step fails; the engine fails its sequences
            raise RuntimeError(f"a pipeline stage's process died: {str(error).splitlines()[0]}") from None

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        if copies:
            self._ray.get([stage.copy_pages.remote(copies) for stage in self.stages])

    def close(self) -> None:
        for stage in self.stages:
            self._ray.kill(stage)
        self.stages = []


def micro_batches(batch: ScheduledBatch, most: int) -> list[ScheduledBatch]:
    """`batch` cut into at most `most` runs of consecutive sequences with about equal tokens each (the
    sequences' order, so the logits' rows, kept)."""
    total = batch.total_tokens
    count = min(most, len(batch.seqs))
    parts, current, done = [], ScheduledBatch(), 0
    for seq, tokens in zip(batch.seqs, batch.num_tokens):
        current.seqs.append(seq)
        current.num_tokens.append(tokens)
        done += tokens
        if len(parts) < count - 1 and done >= total * (len(parts) + 1) / count:
            parts.append(current)
            current = ScheduledBatch()
    if current.seqs:
        parts.append(current)
    return parts
