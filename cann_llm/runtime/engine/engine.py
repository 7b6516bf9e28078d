"""`LLMEngine`: a compiled artifact as a text generator serving many requests at once.

One worker thread owns the model: each step it lets the scheduler pick tokens from every request in
flight (continuous batching), runs them as one batch, samples, and hands text pieces back. Callers on
any thread or event loop submit requests and wait for them: `generate`, `generate_batch`, `stream`,
`generate_async` and `chat` are all `submit` plus a way of waiting.
"""

from __future__ import annotations

import asyncio
import atexit
import heapq
import logging
import numbers
import os
import queue
import threading
import time
import weakref
from collections import Counter, deque
from pathlib import Path
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterator, overload

import numpy as np

from cann_llm.runtime.chat_template import ChatTemplate
from cann_llm.runtime.engine.batch_control import BatchSizeController
from cann_llm.runtime.engine.block_manager import BlockManager
from cann_llm.runtime.engine.config import EngineConfig
from cann_llm.runtime.engine.detokenizer import IncrementalDetokenizer
from cann_llm.runtime.engine.draft_model import DraftModelProposer
from cann_llm.runtime.engine.kv_cache import PagePool
from cann_llm.runtime.engine.runner import ContiguousRunner, PagedRunner
from cann_llm.runtime.engine.outputs import CompletionOutput, RequestOutput
from cann_llm.runtime.engine.sampler import draw, process_logits, token_logprobs
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.engine.scheduler import ScheduledBatch, Scheduler
from cann_llm.runtime.engine.sequence import RequestStats, Sequence, TokenLogprob
from cann_llm.runtime.engine.setting_error import SettingError
from cann_llm.runtime.engine.speculation import NgramProposer
from cann_llm.runtime.engine.structured import GrammarCompiler
from cann_llm.runtime.engine.trial_step import check_generator, trial_step
from cann_llm.runtime.engine.tuning import tuned_settings
from cann_llm.runtime.memory import total_bytes
from cann_llm.runtime.errors import AtcError, invalid_value
from cann_llm.runtime.shape_contract import ShapeContract
from cann_llm.runtime.executor import Executor
from cann_llm.runtime.heap_trim import release_free_heap
from cann_llm.runtime.loader import load_artifact
from cann_llm.runtime.ops import LAST_POSITIONS
from cann_llm.runtime.safe_files import read_text
from cann_llm.runtime.ort_session import enable_process_thread_pool
from cann_llm.runtime.tokenizer import TextTokenizer, lone_surrogate

_DONE = object()
UTILISATION_SAMPLES = 100_000


_log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    """A request the engine could not finish: its step failed for it (its batch-mates went on)."""


class EngineClosed(RuntimeError):
    """The engine was closed before a request could be submitted, or while a call waited for one to finish."""


_OPEN: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Close the engines still open as the interpreter exits (after its other threads are joined, before it
    finalizes): a worker left inside onnxruntime while the interpreter tears down ended the process with
    SIGABRT ("terminate called without an active exception"). Each ends within a step; a forked child's
    copies are not its own to close."""
    for engine in list(_OPEN):
        if engine._pid == os.getpid():
            try:
                engine.close()
            except Exception as error:  # the others are still closed (a pipeline's Ray may have gone first)
                _log.warning("an engine could not be closed at exit: %s", error)


def _params(params: SamplingParams | None, settings: dict) -> SamplingParams:
    """`params` with keyword `settings` (SamplingParams fields) over it, or the settings alone."""
    if params is None:
        return SamplingParams(**settings)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling settings must be a SamplingParams, not {type(params).__name__}")
    return replace(params, **settings) if settings else params


def _token_ids(prompt) -> list[int]:
    """A prompt given as token ids, as ints; TypeError for anything else."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):  # iterable as ints, but never meant as token ids
        raise TypeError("a prompt is a text or a sequence of token ids, not bytes: decode it first")
    try:
        items = list(prompt)
    except TypeError:
        raise TypeError(f"a prompt is a text or a sequence of token ids, not {type(prompt).__name__}") from None
    bad = next((t for t in items if not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise TypeError(f"token ids are integers, not {type(bad).__name__} ({bad!r})")
    return [int(t) for t in items]


def _work(engine: "weakref.ref[LLMEngine]", wake: threading.Event) -> None:
    """The engine's worker thread. It holds the engine only while it takes a turn, so an engine that its
    caller drops without closing it is collected, and its finalizer wakes this thread to end."""
    while (held := engine()) is not None:
        state = held._turn()
        del held
        if state is None:
            return
        if not state:
            wake.wait()
            wake.clear()


def _release(wake: threading.Event, grammars: GrammarCompiler | None, runner) -> None:
    """What an engine holds beyond its memory, let go once (by close() or when it is collected)."""
    wake.set()
    if grammars is not None:
        grammars.close()
    runner.close()


def _texts(requests: list["Request"]) -> list[str]:
    """Each request's text once all have finished. A caller that stops waiting (Ctrl-C, a failed request)
    cancels those still running: no one is left to read them. EngineClosed when the engine was closed under
    them (their text is cut short)."""
    try:
        texts = [request.result() for request in requests]
    except BaseException:
        for request in requests:
            request.cancel()
        raise
    raise_if_closed_under(requests)
    return texts


def raise_if_closed_under(requests: list["Request"]) -> None:
    """EngineClosed when one of `requests`, which only their caller could have cancelled, was cancelled: the
    engine closed under them (their text is cut short)."""
    if any(request.finish_reason == "cancelled" for request in requests):
        raise EngineClosed("the engine was closed before the request finished")


def _streamed(request: "Request") -> Iterator[str]:
    """`request`'s pieces (see `LLMEngine.stream`)."""
    finished = False
    try:
        yield from request.iter_text()
        finished = True
    finally:
        if not finished:
            request.cancel()
    request.result()
    raise_if_closed_under([request])


def _cancel_unfinished(request: "Request") -> None:
    if not request.future.done():
        request.cancel()


@dataclass
class Request:
    """A submitted request: its sequence, the text so far, and ways to wait for it or cancel it."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    engine: "LLMEngine"
    text: str = ""
    future: Future = field(default_factory=Future)
    _pieces: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _wakers: list = field(default_factory=list)

    @property
    def stats(self) -> RequestStats:
        return self.seq.stats

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        """What stopped it, as vLLM reports it: the stop string matched, the stop token id sampled, or None
        (end-of-sequence, the length limit, a cancellation)."""
        if self.detokenizer is not None and self.detokenizer.matched_stop is not None:
            return self.detokenizer.matched_stop
        seq, ids = self.seq, self.seq.output_ids
        if seq.finish_reason != "stop" or not ids or ids[-1] not in seq.params.stop_token_ids:
            return None
        return None if ids[-1] in seq.eos_token_ids and not seq.params.ignore_eos else ids[-1]

    def result(self, timeout: float | None = None) -> str:
        """Block until finished; the generated text."""
        return self.future.result(timeout)

    async def aiter_text(self) -> AsyncIterator[str]:
        """`iter_text` for asyncio: the engine wakes the awaiting loop as pieces arrive."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the loop has closed under a reader it abandoned: no one is waiting
                pass

        self._wakers.append(wake)
        try:
            while True:
                try:
                    piece = self._pieces.get_nowait()
                except queue.Empty:
                    await arrived.wait()
                    arrived.clear()
                    continue
                if piece is _DONE:
                    self._pieces.put(_DONE)  # the end stays the end, for whoever reads next
                    return
                yield piece
        finally:
            self._wakers.remove(wake)

    def iter_text(self) -> Iterator[str]:
        """Text pieces as they are generated, until the request ends (consumes them: one reader; a later one
        gets what the first left, then the end). Leaving early does not cancel the request."""
        while (piece := self._pieces.get()) is not _DONE:
            yield piece
        self._pieces.put(_DONE)  # the end stays the end, for whoever reads next

    def cancel(self) -> None:
        """Stop generating; the pages the request held go back to the pool."""
        self.engine._post(("cancel", self))

    def expire_at(self, deadline: float) -> None:
        """End the request (finish reason `timeout`) if it is still running at `deadline`, a
        `time.monotonic()` instant: the engine checks before each step, so however busy the caller's
        thread or event loop is, it runs at most one step past it."""
        self.engine._post(("deadline", self, deadline))

    def _emit(self, piece: str) -> None:
        if piece:
            self.text += piece
            self._put(piece)

    def _put(self, item) -> None:
        self._pieces.put(item)
        for wake in list(self._wakers):
            wake()


@dataclass
class EngineStats:
    """Counters over the engine's life, and the KV utilisation samples of its steps."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_running: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    step_tokens: Counter = field(default_factory=Counter)  # steps by the tokens they ran (at most the step budget)
    # per-step samples, the latest UTILISATION_SAMPLES kept (a server runs for days)
    page_utilisation: deque = field(default_factory=lambda: deque(maxlen=UTILISATION_SAMPLES))
    token_utilisation: deque = field(default_factory=lambda: deque(maxlen=UTILISATION_SAMPLES))


def _pages_in(megabytes: int, dims: dict, page_size: int) -> int:
    """How many whole pages of this model's KV cache fit in `megabytes` MiB."""
    per_page = PagePool.bytes_per_page(dims, page_size)
    pages = megabytes * 2**20 // per_page
    if pages < 1:
        raise invalid_value(megabytes, "kv_cache_memory_mb", f"it holds no page: one page of {page_size} tokens "
                                                             f"takes {per_page / 2**20:.1f} MiB")
    return pages


DEFAULT_PAGES = 1024


def default_pages(dims: dict, page_size: int, memory: int | None) -> int:
    """The pool's pages when no setting gives them: DEFAULT_PAGES, or as many as fit in half of `memory` (the
    machine's) if fewer, and at least one. The pool is mapped at once and written as it fills: 1024 pages of a
    7B model's cache (128 MiB each) are more than a machine maps, where the pages a 24 GiB one can hold serve
    12,288 tokens."""
    if memory is None:
        return DEFAULT_PAGES
    per_page = PagePool.bytes_per_page(dims, page_size)
    return max(1, min(DEFAULT_PAGES, memory // 2 // per_page))


def _within_contract(metadata: dict, context: int, tokens: int) -> tuple[int, int]:
    """(context, tokens a step) brought within the input shapes the artifact was compiled for (`--input_shape`'s
    ranges and fixed sizes, `--dynamic_batch_size` and `--dynamic_dims`' largest gear): a step's tokens by
    input_ids' second dim (a paged step's are its flattened batch; a contiguous runner feeds each sequence on
    its own, so its chunks are bounded the same way), and a contiguous artifact's context by the mask's (or,
    without a cache, by input_ids', as such a step feeds the whole sequence)."""
    contract = ShapeContract.of(metadata)
    if contract is None:
        return context, tokens
    most = contract.most("input_ids", 1)
    if (metadata.get("kv_cache") or {}).get("layout") != "paged":
        # a step feeds the mask of every token but the last one sampled (never computed), hence one more
        fed = [contract.most("attention_mask", 1), None if metadata["model"].get("kv_cache_io") else most]
        context = min([context, *(n + 1 for n in fed if n)])
    return context, min(tokens, most or tokens)


class LLMEngine:
    """`LLMEngine("model.om", EngineConfig(max_batch_size=8))`, or `LLMEngine("model.om", max_batch_size=8)`.

    The settings and their defaults are `EngineConfig`'s (cann_llm/runtime/engine/config.py); keyword arguments
    override fields of `config`. A paged artifact gets a pool of `kv_cache_pages` pages of its compiled
    page size; an artifact with contiguous past/present I/O reserves `max_context_len` tokens per
    sequence instead.

    `num_speculative_tokens=k` drafts up to k tokens per decoding sequence by prompt lookup and verifies
    them in the same step (cann_llm/runtime/engine/speculation.py), while at most `speculative_max_batch` sequences run:
    beyond that a step is no longer bound by reading the weights, and drafts would cost more than they save.
    Outputs are unchanged by it.

    `process_thread_pool=True` makes onnxruntime's process-wide thread pool, which the engine's many
    sessions then share: decode is faster (cann_llm/runtime/ort_session.py), but onnxruntime requires every
    session created later in the process to use that pool too, which code outside this project (such
    as onnx-graphsurgeon's constant folding) does not do. The CLI, which owns its process, turns it on.
    """

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig | None = None, **overrides):
        self.loaded = load_artifact(model_path)
        # without a config, the settings `atc --auto_tune_mode` measured for this artifact are the defaults
        self.config = config = replace(config or EngineConfig(**tuned_settings(self.loaded.metadata)), **overrides)
        max_batch_size, max_context_len, kv_cache_pages = config.max_batch_size, config.max_context_len, config.kv_cache_pages
        backend, threads = config.backend, config.threads
        metadata = self.loaded.metadata
        check_generator(metadata, str(model_path))
        self.dims = metadata["model"]
        if config.num_speculative_tokens and self.dims.get("recurrent_layers"):
            raise invalid_value(config.num_speculative_tokens, "num_speculative_tokens",
                                "The model's recurrent layers (a hybrid's convolutions or gated delta nets) hold every "
                                "token they computed in a state of fixed size, which cannot take back a rejected "
                                "draft: it generates without speculation (0).")
        # a model that reads its positions from a table (GPT-2's learned ones) reads none past its rows: a
        # sequence ends there (its last token, sampled at the last row, is never read)
        max_context_len = min(max_context_len, self.dims.get("max_positions", max_context_len) + 1)
        max_context_len, step_tokens = _within_contract(metadata, max_context_len, config.max_num_batched_tokens)
        self.max_context_len = max_context_len
        self.vocab_size = int(self.dims["vocab_size"])
        self.tokenizer = self.loaded.tokenizer
        self._chat_template: ChatTemplate | None = None
        self._chat_template_source = None if config.chat_template_file is None else read_text(
            config.chat_template_file)
        self._grammars = None if self.tokenizer is None else GrammarCompiler(
            self.loaded.om.tokenizer_files()["tokenizer.json"], self.vocab_size, self.tokenizer.eos_token_ids)
        pipeline = metadata.get("pipeline")
        # a pipelined model's KV pages are spread over its stages: one page costs all the model's layers
        layers = pipeline["num_layers"] if pipeline else self.dims.get("num_layers", 0)
        self.paged = self.loaded.paged
        if self.paged:
            self.page_size = self.loaded.kv_cache["page_size"]
            if config.kv_cache_memory_mb is not None:
                kv_cache_pages = _pages_in(config.kv_cache_memory_mb, {**self.dims, "num_layers": layers}, self.page_size)
            elif kv_cache_pages is None:
                kv_cache_pages = default_pages({**self.dims, "num_layers": layers}, self.page_size, total_bytes())
            self.runner = self._paged_runner(model_path, pipeline, kv_cache_pages)
            # a hybrid's recurrent states hold whole prefixes in a fixed size: none can be shared by pages
            blocks = BlockManager(kv_cache_pages, self.page_size,
                                  config.enable_prefix_caching and not self.dims.get("recurrent_layers"))
        else:
            self.page_size = max_context_len
            self.runner = ContiguousRunner(self._executor(), metadata["signature"], self.dims)
            blocks = BlockManager(max_batch_size, max_context_len, enable_prefix_caching=False)
        # an export without past/present I/O recomputes its whole sequence each step and holds no cache
        holds_kv = self.paged or self.dims.get("kv_cache_io")
        self.kv_bytes_per_page = PagePool.bytes_per_page({**self.dims, "num_layers": layers},
                                                         self.page_size) if holds_kv else 0
        try:
            trial_step(self.runner, self.vocab_size, self.loaded.om.path)
        except BaseException:
            self.runner.close()  # a pipeline's stage actors go with the engine that failed
            raise
        self.blocks = blocks
        self.scheduler = Scheduler(blocks, max_batch_size, step_tokens, config.priority_aging_s,
                                   self.dims.get("rotary_switch_length") if self.paged else None)
        if config.draft_model is not None:
            if not self.paged:
                raise invalid_value(config.draft_model, "draft_model",
                                    "A draft model verifies against a paged target (atc --enable_paged_attention=1).")
            self.proposer = DraftModelProposer(config.draft_model, config.num_speculative_tokens, kv_cache_pages,
                                               self.vocab_size, backend, threads, config.native_matmul)
        else:
            self.proposer = NgramProposer(config.num_speculative_tokens)
        self.speculative_max_batch = config.speculative_max_batch
        self.batch_control = None if config.max_step_latency_ms is None else BatchSizeController(
            config.max_step_latency_ms / 1000, max_batch_size)
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, seq_id)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()
        self._post_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _release, self._wake, self._grammars, self.runner)
        self._finalizer.atexit = False  # _close_at_exit closes it, the worker first
        self._pid = os.getpid()
        _OPEN.add(self)
        release_free_heap()  # what loading freed (the tokenizer's JSON, graph protos) leaves the resident set

    def _executor(self) -> Executor:
        config = self.config
        if config.process_thread_pool and config.backend == "onnxruntime":
            enable_process_thread_pool(config.threads)
        return Executor(self.loaded, config.backend, config.threads, host_attention=config.host_attention,
                        native_matmul=config.native_matmul, share_weights=config.share_weights,
                        huge_pages=config.huge_pages)

    def _pool_too_large(self, kv_cache_pages: int, error: OSError | OverflowError) -> AtcError:
        """E10001 naming the setting that sized a page pool the machine cannot map, and what it would take."""
        per_page = PagePool.bytes_per_page(self.dims, self.page_size)
        megabytes = self.config.kv_cache_memory_mb
        flag, value = ("kv_cache_pages", kv_cache_pages) if megabytes is None else ("kv_cache_memory_mb", megabytes)
        return invalid_value(value, flag, f"A pool of {kv_cache_pages} pages of {self.page_size} tokens would take "
                                          f"{kv_cache_pages * per_page / 2**30:.1f} GiB, more than this machine can "
                                          f"map ({getattr(error, 'strerror', None) or error}).")

    def _paged_runner(self, model_path, pipeline: dict | None, kv_cache_pages: int) -> PagedRunner:
        """The runner over this process's page pool, or over the stages' pools when the artifact is the first
        stage of a pipeline (its other stages are read beside it)."""
        if not pipeline:
            try:
                pool = PagePool.of(self.dims, kv_cache_pages, self.page_size)
            except (OSError, OverflowError) as error:  # mmap's ENOMEM, or a size past its range
                raise self._pool_too_large(kv_cache_pages, error) from None
            return PagedRunner(self._executor(), pool)
        if pipeline["stage"] != 0:
            first = pipeline["files"][0]
            raise invalid_value(model_path, "model", f"This is stage {pipeline['stage']} of a pipeline: run its first "
                                                     f"stage, {first}, which reads the others beside it.")
        from cann_llm.runtime.engine.pipeline import PipelinedRunner

        folder = Path(self.loaded.om.path).parent
        paths = [folder / name for name in pipeline["files"]]
        for path in paths:
            if not path.is_file():
                raise AtcError("E13001", path, f"No such file or directory (stage {paths.index(path)} of the pipeline)")
        return PipelinedRunner(paths, kv_cache_pages, self.page_size, self.config.backend, self.config.threads,
                               self.config.native_matmul, LAST_POSITIONS in self.loaded.input_names)

    # ---- submitting -------------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, **kwargs) -> Request:
        """Queue one request (text, or token ids) for one sequence; returns its handle at once. ValueError
        for a prompt or settings it would refuse (see `encode`), a structured output that does not compile,
        or `n` > 1 (`generate` takes that)."""
        params = _params(params, kwargs)
        if params.n != 1:
            raise SettingError("n", "submit runs one sequence: pass n > 1 to generate, or submit n requests")
        for setting, name, ids in (("stop_token_ids", "stop token id", params.stop_token_ids),
                                   ("logit_bias", "logit_bias token id", [t for t, _ in params.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise SettingError(setting, f"{name} {bad} is outside the vocabulary [0, {self.vocab_size})")
        ids = self.encode(prompt)
        self._check_pool_holds(len(ids))
        constraint = None
        if params.structured_output is not None:
            if self._grammars is None:
                raise SettingError("structured_output",
                                   "a structured output needs the model's tokenizer; recompile with atc --tokenizer=DIR")
            constraint = self._grammars.constraint(params.structured_output)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        seq = Sequence(list(ids), params, eos, constraint=constraint)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        request = Request(seq, detok, self)
        self._post(("add", request))
        return request

    def _check_pool_holds(self, prompt_tokens: int) -> None:
        """ValueError naming the pool's setting for a prompt that the whole pool could not hold. Its output is
        bounded by the pool as by max_context_len instead: one that outgrows it ends with "length" (refusing
        on max_new_tokens would refuse requests that stop long before it)."""
        needed = -(-prompt_tokens // self.page_size)
        if needed > self.blocks.num_pages:
            setting = "kv_cache_pages" if self.config.kv_cache_memory_mb is None else "kv_cache_memory_mb"
            given = f"{setting} gives" if self.config.kv_cache_pages is not None or self.config.kv_cache_memory_mb \
                is not None else "half of this machine's memory (kv_cache_pages unset) holds"
            raise SettingError(setting, f"{given} a pool of {self.blocks.num_pages} pages of {self.page_size} tokens; "
                             f"the prompt's {prompt_tokens} tokens need {needed}")

    # for type checkers: one prompt without SamplingParams is its text (or, with `n` given, outputs when
    # n > 1); prompts, or SamplingParams, outputs
    @overload
    def generate(self, prompts: str | list[int], sampling_params: int | None = None,
                 temperature: float | None = None, *, n: int, **kwargs: Any) -> str | list[RequestOutput]: ...

    @overload
    def generate(self, prompts: str | list[int], sampling_params: int | None = None,
                 temperature: float | None = None, **kwargs: Any) -> str: ...

    @overload
    def generate(self, prompts: list[str] | list[list[int]], sampling_params: int | None = None,
                 temperature: float | None = None, **kwargs: Any) -> list[RequestOutput]: ...

    @overload
    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams], temperature: float | None = None,
                 **kwargs: Any) -> list[RequestOutput]: ...

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | int | None = None,
                 temperature: float | None = None, **kwargs):
        """`generate(prompt, max_new_tokens, temperature)`: the completion of one prompt, as text.

        `generate(prompts, SamplingParams(...))` (vLLM's call) or `generate([prompt, ...], **settings)`: a
        `RequestOutput` per prompt, in order, each with `n` outputs, computed together. A prompt is a
        text or a list of token ids; keyword settings are `SamplingParams` fields (`max_tokens` as
        vLLM spells it)."""
        if isinstance(sampling_params, int) and not isinstance(sampling_params, bool):
            kwargs["max_new_tokens"], sampling_params = sampling_params, None
        if temperature is not None:
            kwargs["temperature"] = temperature
        # a list of prompts, not one prompt's token ids
        many = isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], (str, list, tuple, np.ndarray))
        many_params = isinstance(sampling_params, (list, tuple))
        if many_params:  # vLLM's one SamplingParams per prompt
            if not many or len(sampling_params) != len(prompts):
                raise ValueError("a list of SamplingParams needs a list of prompts of the same length")
            each = [_params(p, kwargs) for p in sampling_params]
        else:
            each = [_params(sampling_params, kwargs)] * (len(prompts) if many else 1)
        started: list[tuple[object, list[Request]]] = []
        try:
            for prompt, params in zip(list(prompts) if many else [prompts], each):
                started.append((prompt, []))
                for i in range(params.n):
                    seed = None if params.seed is None else params.seed + i
                    started[-1][1].append(self.submit(prompt, replace(params, n=1, seed=seed)))
            texts = _texts([request for _, requests in started for request in requests])
        except BaseException:  # one refused, or the wait given up: none of the batch runs on
            for _, requests in started:
                for request in requests:
                    request.cancel()
            raise
        if not many and sampling_params is None and each[0].n == 1:
            return texts[0]
        return [self._request_output(prompt, requests) for prompt, requests in started]

    def _request_output(self, prompt, requests: list[Request]) -> RequestOutput:
        first = requests[0].seq
        outputs = [CompletionOutput(i, r.text, list(r.output_ids), r.finish_reason,
                                    list(r.seq.logprobs) if r.seq.params.logprobs is not None else None,
                                    r.stop_reason)
                   for i, r in enumerate(requests)]
        return RequestOutput(str(first.seq_id), prompt if isinstance(prompt, str) else None,
                             first.token_ids[:first.num_prompt], outputs, [r.stats for r in requests],
                             list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None)

    def generate_batch(self, prompts: list[str | list[int]], params: SamplingParams | None = None, **kwargs) -> list[str]:
        """Completions of all `prompts` (one each), computed together."""
        if _params(params, kwargs).n != 1:
            raise SettingError("n", "generate_batch returns one completion a prompt: pass n > 1 to generate")
        prompts = list(prompts)
        if not prompts:
            return []
        return [output.outputs[0].text for output in self.generate(list(prompts), params, **kwargs)]

    async def generate_async(self, prompt: str | list[int], params: SamplingParams | None = None, **kwargs) -> str:
        """`generate` for asyncio: concurrent callers share the engine's batches; cancelling the awaiting task
        cancels the request."""
        request = self.submit(prompt, params, **kwargs)
        try:
            text = await asyncio.wrap_future(request.future)
        except BaseException:
            request.cancel()
            raise
        raise_if_closed_under([request])
        return text

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, **kwargs) -> Iterator[str]:
        """Text pieces as they are generated. The request is submitted (or refused, as by `submit`) by this
        call; closing or dropping the iterator early cancels it; one that fails raises `GenerationFailed`
        after the pieces it made, and `EngineClosed` if the engine is closed under it."""
        request = self.submit(prompt, params, **kwargs)
        pieces = _streamed(request)
        weakref.finalize(pieces, _cancel_unfinished, request).atexit = False  # dropped before it was read
        return pieces

    def chat(self, messages: list[dict], params: SamplingParams | None = None, tools: list[dict] | None = None,
             **kwargs) -> str:
        """The assistant's reply to `messages`, through the model's chat template (with `tools`, OpenAI's
        function definitions, where the template renders them)."""
        if not messages:
            raise SettingError("prompt", "there are no messages to answer")
        return _texts([self.submit(self.chat_prompt(messages, tools), params, **kwargs)])[0]

    def embed_tokens(self, ids) -> np.ndarray:
        """Rows `ids` of the model's input embedding table, float32 `[n, hidden]` (LongContext's hybrid scoring)."""
        return self.loaded.embed_tokens(ids)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """`messages` rendered by the chat template and tokenized as the template spells special tokens."""
        return self._require_tokenizer().encode(self.chat_text(messages, tools=tools), add_special_tokens=False)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """`messages` rendered by the chat template (ending where the assistant speaks, unless told not to),
        with `tools` (OpenAI's function definitions) where the template renders them."""
        return self._template().render(messages, add_generation_prompt, tools)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the model's chat template has a place for tool definitions."""
        return self._template().renders_tools

    def warm_up(self) -> None:
        """Run what a first request would otherwise pay for: llguidance's tokenizer, the chat template, a batch
        of two sequences (prefill chunks of two lengths, then decode steps); the prefix cache forgets them."""
        if self._grammars is not None:
            self._grammars.prepare()
        if self.tokenizer is not None:
            try:
                self._template()
            except AtcError:  # compiled without a chat template: chat requests say so themselves
                pass
        longest = max(1, min(40, self.max_context_len - 4))
        prompts = [[t % self.vocab_size for t in range(length)] for length in sorted({min(3, longest), longest})]
        self.generate(prompts, SamplingParams(max_new_tokens=min(4, self.max_context_len - longest), temperature=0,
                                              ignore_eos=True))
        self.reset_prefix_cache()
        # what the counters report (/metrics) starts from the first real request
        self.stats = EngineStats()
        self.blocks.prefix_queries = self.blocks.prefix_hits = 0

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt pages not in use, before the next request is admitted."""
        self._post(("reset", None))

    def close(self) -> None:
        """Stop the worker; requests still in flight are cancelled. An engine dropped without it is closed
        when it is collected, its requests with it (none is left that anyone holds)."""
        with self._post_lock:
            self._closed = True
        self._wake.set()
        if self._worker is not None:
            self._worker.join()
        self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the worker -------------------------------------------------------------------------------

    def _post(self, message) -> None:
        # under the lock close() sets `_closed` by: a message is either refused or in the inbox before the
        # worker can read `_closed`, and the worker drains the inbox once more after reading it
        if self._pid != os.getpid():  # its worker thread and onnxruntime's threads stayed in the parent
            raise RuntimeError("an LLMEngine does not survive fork(): make it in the process that uses it (or use "
                               "multiprocessing's 'spawn' or 'forkserver' start method)")
        with self._post_lock:
            if self._closed:
                if message[0] in ("cancel", "deadline"):
                    return  # closing cancels every request still in flight
                raise EngineClosed("the engine is closed")
            self._inbox.put(message)
            self._ensure_worker()  # before close() can look for a worker to join
        self._wake.set()

    def _ensure_worker(self) -> None:
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=_work, args=(weakref.ref(self), self._wake), name="llm-engine",
                                                daemon=True)
                self._worker.start()

    def _turn(self) -> bool | None:
        """One turn of the worker: True when it stepped, False when there is nothing to do until woken, None
        once the engine is closed (the requests still in flight cancelled)."""
        closed = self._closed
        self._drain_inbox()
        if closed:
            for request in list(self._requests.values()):
                self._cancel(request)
            return None
        self._expire()
        if not self.scheduler.has_work():
            return False
        try:
            self.step()
        except Exception as error:  # no one sequence's fault (step isolates those): fail the step's
            for seq in list(self.scheduler.running) or list(self.scheduler.waiting)[:1]:
                self._fail(seq, error)  # the one being admitted, if none ran: the next step progresses
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request, *deadline = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "deadline":
                heapq.heappush(self._deadlines, (deadline[0], request.seq.seq_id))
                if len(self._deadlines) > 2 * len(self._requests) + 64:  # most for requests long finished
                    self._deadlines = [d for d in self._deadlines if d[1] in self._requests]
                    heapq.heapify(self._deadlines)
            elif kind == "add":
                self._requests[request.seq.seq_id] = request
                self.scheduler.add(request.seq)
                self.stats.prompt_tokens += request.seq.num_prompt
            elif kind == "reset":
                self.blocks.reset_prefix_cache()
            elif request.seq.seq_id in self._requests:
                self._cancel(request)

    def _expire(self) -> None:
        """End the requests whose deadline has passed."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            request = self._requests.get(heapq.heappop(self._deadlines)[1])
            if request is not None:
                self._cancel(request, "timeout")

    def _cancel(self, request: Request, reason: str = "cancelled") -> None:
        self.scheduler.abort(request.seq, reason)
        self.runner.release(request.seq)
        self._complete(request)

    def step(self) -> None:
        """One scheduling step: draft, schedule, run the batch, sample (verifying drafts), stream, retire."""
        self._draft()
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.runner.release(seq)
        self.stats.preemptions += len(batch.preempted)
        for seq in batch.finished:
            self.runner.release(seq)
            self._complete(self._requests[seq.seq_id])
        if not batch.seqs:
            return
        self.runner.copy_pages(self.blocks.pending_copies)
        self.blocks.pending_copies.clear()
        self._sample_utilisation(batch)
        sampling = [not seq.finished and seq.num_computed + count >= len(seq.token_ids)
                    for seq, count in zip(batch.seqs, batch.num_tokens)]  # not a prefill chunk short of the prompt's end
        constrained = [seq for seq, samples in zip(batch.seqs, sampling) if samples and seq.constraint is not None]
        # the grammars' masks for the first token of each, computed while the model runs the step
        masks = self._grammars.masks([seq.constraint for seq in constrained]) if constrained else None
        mask_row = {seq.seq_id: row for row, seq in enumerate(constrained)}
        started = time.perf_counter()
        outcomes = self._run(batch)
        if self.batch_control is not None:
            decode_only = all(count == 1 + len(seq.draft) for seq, count in zip(batch.seqs, batch.num_tokens))
            self.scheduler.batch_cap = self.batch_control.observe(time.perf_counter() - started, len(batch.seqs),
                                                                  decode_only)
        self.stats.steps += 1
        self.stats.step_tokens[sum(batch.num_tokens)] += 1
        done = ScheduledBatch()
        for seq, count, outcome, samples in zip(batch.seqs, batch.num_tokens, outcomes, sampling):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                if seq.scores_prompt(count):
                    self._prompt_logprobs(seq, outcome)
                    outcome = outcome[-1:]
                if samples:
                    first_mask = masks.result(mask_row[seq.seq_id]) if seq.constraint is not None else None
                    self._sample(seq, outcome, first_mask)
            except Exception as error:  # this sequence's inputs or settings: only it fails
                self._fail(seq, error)
                continue
            done.seqs.append(seq)
            done.num_tokens.append(count)
        self.scheduler.account(done)
        for seq in self.scheduler.retire():
            self.runner.release(seq)
            self._complete(self._requests[seq.seq_id])

    def _run(self, batch: ScheduledBatch) -> list[np.ndarray | Exception]:
        """Each sequence's logits rows (`Sequence.logit_rows`), or the error that running it raised.

        A batch that fails is run again one sequence at a time, so the one that broke it fails alone:
        each rerun writes the same keys and values to the same slots, and the others go on unchanged.
        """
        try:
            logits = self.runner.run(batch)
        except Exception as error:
            if len(batch.seqs) == 1:
                return [error]
            return [self._run(ScheduledBatch([seq], [count]))[0] for seq, count in zip(batch.seqs, batch.num_tokens)]
        rows, start = [], 0
        for seq, count in zip(batch.seqs, batch.num_tokens):
            rows.append(logits[start:start + seq.logit_rows(count)])
            start += len(rows[-1])
        return rows

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End `seq` with finish reason "error": its pages freed, its caller given a `GenerationFailed`."""
        self.scheduler.abort(seq, "error")
        self.runner.release(seq)
        request = self._requests.get(seq.seq_id)
        # a coded error says what went wrong; anything else is a defect, logged with where it happened
        _log.error("request %s failed%s", seq.seq_id, f": {error}" if isinstance(error, AtcError) else "",
                   exc_info=None if isinstance(error, AtcError) else (type(error), error, error.__traceback__))
        if request is not None:
            failure = GenerationFailed(f"request {seq.seq_id} failed: {type(error).__name__}: {error}")
            self._complete(request, failure)

    def _draft(self) -> None:
        """Give each decoding sequence a draft to verify, while the batch is small enough to gain from it."""
        running = self.scheduler.running
        drafting = self.proposer.num_tokens and len(running) <= self.speculative_max_batch
        decoding, limits = [], []
        for seq in running:
            seq.draft = []  # one the last step's budget left unscheduled is not carried over
            if drafting and seq.num_uncomputed == 1:
                decoding.append(seq)
                limits.append(min(self.max_context_len - len(seq.token_ids), seq.remaining_tokens) - 1)
        for seq, draft in zip(decoding, self.proposer.propose_batch(decoding, limits) if decoding else ()):
            seq.draft = draft
            if seq.constraint is not None:  # a draft the grammar refuses would be rejected anyway
                seq.draft = seq.draft[:seq.constraint.valid_prefix(seq.draft)]

    def _prompt_logprobs(self, seq: Sequence, rows: np.ndarray) -> None:
        """Log-probabilities of the prompt tokens that `rows` (a prefill chunk's, one a position) predict;
        a chunk computed again after a preemption adds nothing."""
        top = seq.params.prompt_logprobs
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(TokenLogprob(seq.token_ids[0], None))
        for position, row in enumerate(rows, seq.num_computed + 1):
            if position == len(seq.prompt_logprobs) and position < seq.num_prompt:
                logprob, best = token_logprobs(row, seq.token_ids[position], top)
                seq.prompt_logprobs.append(TokenLogprob(seq.token_ids[position], logprob, tuple(best)))

    def _sample(self, seq: Sequence, rows: np.ndarray, first_mask: np.ndarray | None = None) -> None:
        """Sample row after row, each after the draft token before it; stop at the first that differs.

        Every kept token is drawn from the model's distribution given the tokens before it, one draw each,
        exactly as without a draft. Under a structured output each row is masked by the grammar's state
        after the tokens before it (the first row's mask computed during the step).
        """
        draft, seq.draft = seq.draft, []
        request = self._requests[seq.seq_id]
        params = seq.params
        self.stats.draft_tokens += len(draft)
        for position, row in enumerate(rows):
            allowed = None
            if seq.constraint is not None:
                allowed = first_mask if position == 0 and first_mask is not None else seq.constraint.allowed()
            token = draw(process_logits(row, params, seq.token_ids, seq.num_prompt, seq.banned, allowed),
                         params, seq.rng)
            if params.logprobs is not None:
                logprob, top = token_logprobs(row, token, params.logprobs)
                seq.logprobs.append(TokenLogprob(token, logprob, tuple(top)))
            if not position:
                self.proposer.observe(seq.seq_id, token)
            seq.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
                if seq.constraint.done:
                    seq.finish("stop")
            self.stats.generated_tokens += 1
            if len(seq.token_ids) >= self.max_context_len:
                seq.finish("length")
            self._stream(request)
            if position == len(draft) or token != draft[position]:
                break
            self.stats.accepted_tokens += 1
            if seq.finished:
                break

    def _stream(self, request: Request) -> None:
        if request.detokenizer is None:
            return
        piece, stopped = request.detokenizer.add(request.seq.output_ids)
        request._emit(piece)
        if stopped:
            request.seq.finish("stop")

    def _complete(self, request: Request, error: Exception | None = None) -> None:
        self._requests.pop(request.seq.seq_id, None)
        self.proposer.forget(request.seq.seq_id)
        if request.detokenizer is not None:
            request._emit(request.detokenizer.flush())
        # the future first: whoever is told when it is done (a server's accounting) is done before a
        # reader of the stream sees its end
        if not request.future.done():
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(request.text)
        request._put(_DONE)

    def _sample_utilisation(self, batch: ScheduledBatch) -> None:
        """Pages holding live tokens / pages allocated, and live tokens / allocated slots, for this step."""
        running = self.scheduler.running
        self.stats.peak_running = max(self.stats.peak_running, len(running))
        used = self.blocks.num_used
        if not self.paged or not used:
            return
        scheduled = {id(s): c for s, c in zip(batch.seqs, batch.num_tokens)}
        live_pages: set[int] = set()
        live_tokens = 0
        for seq in running:
            tokens = seq.num_computed + scheduled.get(id(seq), 0)
            live_pages.update(seq.block_table[:-(-tokens // self.page_size)])
            live_tokens += tokens
        self.stats.page_utilisation.append(len(live_pages) / used)
        self.stats.token_utilisation.append(live_tokens / (used * self.page_size))

    def _template(self) -> ChatTemplate:
        """The chat template, compiled on first use and kept."""
        if self._chat_template is None:
            files = dict(self.loaded.om.tokenizer_files())
            if self._chat_template_source is not None:
                files["chat_template.jinja"] = self._chat_template_source
            self._chat_template = ChatTemplate(files)
        return self._chat_template

    def encode(self, prompt: str | list[int]) -> list[int]:
        """The token ids `submit` would run for `prompt`; ValueError for one it would refuse: empty, not
        valid UTF-8, ids outside [0, vocab_size), or not shorter than `max_context_len` (a text is bounded
        by its length in characters before it is tokenized)."""
        if isinstance(prompt, str):
            ids = self._encode_text(prompt)
        else:
            ids = _token_ids(prompt)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise SettingError("prompt", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise SettingError("prompt", "the prompt is empty")
        if len(ids) >= self.max_context_len:
            raise SettingError("prompt", f"the prompt has {len(ids)} tokens; max_context_len is {self.max_context_len}")
        return ids

    def _encode_text(self, text: str) -> list[int]:
        tokenizer = self._require_tokenizer()
        at = lone_surrogate(text)
        if at is not None:
            raise SettingError("prompt", f"the prompt is not valid UTF-8 (a lone surrogate at character {at})")
        # no token is longer than the longest string of the vocabulary: a longer text cannot fit
        most = self.max_context_len * tokenizer.max_token_chars
        if len(text) > most:
            raise SettingError("prompt", f"the prompt has {len(text)} characters; at most {most} can fit in max_context_len "
                             f"({self.max_context_len}) tokens")
        return tokenizer.encode(text)

    def _require_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise SettingError("tokenizer", "the model was compiled without a tokenizer, so it takes token ids, not "
                                            "text: compile it again with atc --tokenizer=DIR (the folder of its "
                                            "tokenizer.json)")
        return self.tokenizer
