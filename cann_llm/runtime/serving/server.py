"""`Server`: the engines behind the HTTP routes, and everything about a request that is not HTTP.

Every request is admitted or refused before any work (`Refusal`: 401 without a valid key, 404 for an
unknown model, 429 when its key's quota cannot cover all it may use or the model's queue is full, 400 for
a blocked prompt or one the engine refuses, 503 while loading or shutting down or when its KV pages could
take the process past `--max-memory`). Admission reserves the
quota and the queue place in one step, so concurrent requests cannot all pass one check. Once admitted it
is a `Generation`, which ends as completed, cancelled (the client gone: 499, the timeout: 504, the
shutdown: 503) or failed (500: a fault in its step, which fails it alone); its accounting (metrics, the
quota's refund of what it did not use, audit, the pending count) happens once, when the engine is done
with it, however it ended. `drain` stops admitting, lets what is in flight finish within the grace period
and ends the rest. All of it runs from plain Python and asyncio: the routes only parse, call and serialise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import AsyncIterator, Awaitable, Callable, NoReturn

from cann_llm.runtime.conversation import Conversation, ConversationManager
from cann_llm.runtime.engine.config import EngineConfig
from cann_llm.runtime.engine.engine import EngineClosed, GenerationFailed, LLMEngine, Request
from cann_llm.runtime.engine.sampling import SamplingParams
from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.memory import available_bytes, resident_bytes
from cann_llm.runtime.serving.breaker import CircuitBreaker
from cann_llm.runtime.serving.guard import Guard
from cann_llm.runtime.serving.metrics import DEFAULT_PREFIX, ServerMetrics
from cann_llm.runtime.serving.tools import described

_POLL_S = 0.05  # how often a drain looks at what is still in flight
_log = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """Limits of the service."""

    max_pending: int = 256          # requests admitted per model (running + waiting) before 429
    request_timeout_s: float = 300.0
    shutdown_grace_s: float = 10.0
    retry_after_s: int = 1
    max_body_bytes: int = 4 * 1024 * 1024
    metrics_prefix: str = DEFAULT_PREFIX
    max_memory_mb: int | None = None  # refuse (503) what could grow the process's resident memory past this
    breaker_threshold: int = 5        # failed requests in a row that open a model's circuit breaker (0: never)
    breaker_cooldown_s: float = 10.0


class Refusal(Exception):
    """Why a request gets no answer: an HTTP status and OpenAI's error fields (`param` the field at fault,
    `Retry-After` for a 429); `final` when no retry can succeed (a spent quota, models that failed to load),
    which clients that retry a 429 or 503 by themselves are told."""

    def __init__(self, status: int, message: str, kind: str, retry_after_s: int | None = None,
                 param: str | None = None, final: bool = False):
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after_s = status, message, kind, retry_after_s
        self.param, self.final = param, final


@dataclass(eq=False)
class Generation:
    """One admitted request: the model, the caller's key, the endpoint, and the engine's request."""

    model: str
    key: str | None
    endpoint: str
    request: Request
    blocked_terms: tuple[str, ...]
    reserved: int = 0               # quota tokens held for it: all it may generate, and its prompt if it charges it
    charges_prompt: bool = True     # the first of `n` choices carries the prompt they share
    turn: "Turn | None" = None      # the turn of a conversation the server keeps
    kv_pages: int = 0               # KV pages it may need at most (for --max-memory)
    deadline: float = float("inf")  # the `time.monotonic()` instant it is ended at (504), set on arrival
    ended_by: str | None = None     # who cancelled it: "client", "timeout", "shutdown", "failed" or "refused"
    # done once the server has accounted it: the engine's future can read done (set by the engine's thread)
    # before its callbacks, the accounting among them, have run
    settled: Future = field(default_factory=Future)

    @property
    def text(self) -> str:
        return self.request.text

    def tokens_in_text(self, characters: int | None = None) -> int:
        """How many output tokens make the first `characters` the client has of the text (all of it, when it
        has ended): every one, but where a stop string was cut from the text, or a stream has not yet sent
        the text of some, the fewest that make it (IncrementalDetokenizer.tokens_within)."""
        detok = self.request.detokenizer
        if detok is None or (characters is None and detok.matched_stop is None):
            return len(self.request.seq.output_ids)
        return detok.tokens_within(len(self.text) if characters is None else characters)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason: `content_filter` when a block-listed term stopped it."""
        detok = self.request.detokenizer
        if detok is not None and detok.matched_stop in self.blocked_terms:
            return "content_filter"
        return "length" if self.request.finish_reason == "length" else "stop"

    def outcome(self) -> tuple[int, str]:
        """(HTTP status, metrics outcome) of a request the engine is done with."""
        future = self.request.future
        if self.request.finish_reason == "error" or (future.done() and future.exception() is not None):
            return 500, "failed"
        if self.request.finish_reason == "timeout":  # the engine ended it at the deadline `complete_all` set
            return 504, "cancelled"
        if self.request.finish_reason != "cancelled":
            return 200, "completed"
        return {"timeout": 504, "shutdown": 503, "failed": 500, "refused": 400}.get(self.ended_by, 499), "cancelled"


@dataclass(eq=False)
class Turn:
    """A turn of a conversation the server keeps, holding the conversation's lock until its answer is in."""

    conversation: Conversation
    lock: threading.Lock
    asked: bool = False  # its user message is in the conversation
    _once: threading.Lock = field(default_factory=threading.Lock)

    def end(self, answer: str | None) -> None:
        """Record the answer (None: the turn failed or was refused, and its question is taken back out);
        only the first call counts (a refused admission may end it from two threads)."""
        if not self._once.acquire(blocking=False):
            return
        if self.asked:
            if answer is None:
                self.conversation.turns.pop()
            else:
                self.conversation.reply(answer)
        self.lock.release()


class Server:
    """`Server({"name": "model.om"}, EngineConfig(...), settings, guard)`: `load()`, then `start` requests
    and `complete` or `stream` them; `drain` at the end. Without an EngineConfig each model starts from the
    settings it was tuned to, with `engine_overrides` over them."""

    def __init__(self, model_paths: dict[str, str], engine_config: EngineConfig | None = None,
                 settings: ServerSettings | None = None, guard: Guard | None = None,
                 engine_overrides: dict | None = None):
        self.model_paths, self.engine_config = model_paths, engine_config
        self.engine_overrides = engine_overrides or {}
        self.settings = settings or ServerSettings()
        self.guard = guard or Guard()
        self.engines: dict[str, LLMEngine] = {}
        self.metrics: ServerMetrics | None = None
        self.conversations: dict[str, ConversationManager] = {}  # by model name; one per engine
        self.pending = dict.fromkeys(model_paths, 0)
        self.ready = threading.Event()
        self.error: str | None = None
        self.closing = False
        self._in_flight: set[Generation] = set()
        self._kv_demand: dict[int, int] = {}  # by engine: KV pages the requests in flight may need at most
        self.breakers: dict[str, CircuitBreaker] = {}  # by model name; one per engine
        # a conversation's turn may wait for the model to summarise its history: on threads of its own, so
        # that turns compacting at once never hold up every other request's admission (asyncio's default
        # pool has min(32, cores + 4) threads); one per sequence the engines run at once, as more could only
        # queue in the engines
        self._turns: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # accounting happens on the engines' threads
        self._closed = False
        self._grace_over = False

    # ---- the engines ---------------------------------------------------------------------------------

    def load(self, on_loading: Callable[[list[str], str], None] | None = None) -> None:
        """Load one engine per file (the same artifact under two names is loaded once); `on_loading(names,
        path)` is told before each. A failure is kept in `error`, for /health to report."""
        by_file: dict[tuple[int, int], list[str]] = {}
        try:
            for name, path in self.model_paths.items():
                stat = os.stat(path)
                by_file.setdefault((stat.st_dev, stat.st_ino), []).append(name)
            for names in by_file.values():
                if self.closing:
                    self.error = "the server was stopped before its models were loaded"
                    return
                path = self.model_paths[names[0]]
                if on_loading is not None:
                    on_loading(names, path)
                engine = LLMEngine(path, self.engine_config, **self.engine_overrides)
                self.engines.update(dict.fromkeys(names, engine))
                engine.warm_up()  # before /health says ready, so no first request pays for it
            self._fit_pools_to_memory()
            managers = {id(engine): ConversationManager(engine) for engine in self.engines.values()}
            self.conversations = {name: managers[id(engine)] for name, engine in self.engines.items()}
            self._turns = ThreadPoolExecutor(sum(e.config.max_batch_size for e in self._distinct_engines()),
                                             thread_name_prefix="conversation-turn")
            breakers = {id(engine): CircuitBreaker(self.settings.breaker_threshold, self.settings.breaker_cooldown_s)
                        for engine in self.engines.values()}
            self.breakers = {name: breakers[id(engine)] for name, engine in self.engines.items()}
            self.metrics = ServerMetrics(self.engines, self.settings.metrics_prefix)
        except Exception as error:  # reported by /health; the process stays up to say so
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.ready.set()

    def _distinct_engines(self) -> list[LLMEngine]:
        """Each engine once, in load order (one file under two names is one engine)."""
        return list(dict.fromkeys(self.engines.values()))

    def _fit_pools_to_memory(self) -> None:
        """With `max_memory_mb`, each engine's KV pool keeps only the pages the limit leaves room for (shared
        equally, a tenth of the limit kept for everything else that grows): the pool is written lazily and its
        prefix cache keeps pages resident, so a pool larger than that would grow past the limit and stay
        there."""
        limit = self.settings.max_memory_mb
        if limit is None:
            return
        engines = self._distinct_engines()
        spare = (limit * 2 ** 20 * (1 - _MEMORY_MARGIN) - resident_bytes()) / len(engines)
        for engine in engines:
            engine.blocks.limit_pages(engine.blocks.touched + max(0, int(spare // engine.kv_bytes_per_page)))

    def pool_lines(self) -> list[str]:
        """A line per engine: its KV pool's pages and the memory they take once written; and a warning when,
        without --max-memory, the pools written in full would take more than the machine has available."""
        lines = []
        engines = self._distinct_engines()
        for engine in engines:
            names = ", ".join(name for name, e in self.engines.items() if e is engine)
            pages = engine.blocks.num_pages
            lines.append(f"{names}: KV pool of {pages} pages of {engine.page_size} tokens, "
                         f"{pages * engine.kv_bytes_per_page / 2 ** 20:.0f} MiB once all are written")
        growth = sum((e.blocks.num_pages - e.blocks.touched) * e.kv_bytes_per_page for e in engines)
        available = available_bytes()
        if self.settings.max_memory_mb is None and available is not None and growth > available:
            # the pools are mapped lazily and written pages stay (the prefix cache keeps them): enough distinct
            # prompts write them all, long after the start went well
            lines.append(f"warning: the KV pools written in full take {growth / 2 ** 20:.0f} MiB more, past the "
                         f"{available / 2 ** 20:.0f} MiB this machine has available now, and enough distinct "
                         f"prompts write them all; give --max-memory MiB (or fewer --kv_cache_pages)")
        return lines

    def status(self) -> str:
        """`shutting down`, `loading`, `error` (the load failed) or `ok`."""
        if self.closing:
            return "shutting down"
        if not self.ready.is_set():
            return "loading"
        return "error" if self.error else "ok"

    def model_names(self) -> list[str]:
        return sorted(self.engines)

    # ---- admission -----------------------------------------------------------------------------------

    def authorise(self, authorization: str | None) -> str | None:
        """The caller's key (None without keys configured); Refusal 401 without a valid one."""
        key, refusal = self.guard.authorise(authorization)
        if refusal:
            raise Refusal(401, refusal, "authentication_error")
        return key

    def engine_for(self, authorization: str | None, model: str | None) -> tuple[str | None, str, LLMEngine]:
        """(the caller's key, the model's name, its engine); Refusal 503 while not serving, 401 without a
        valid key, 404 for a model not served."""
        status = self.status()
        if status != "ok":
            why = {"loading": "the models are still loading", "shutting down": "the server is shutting down",
                   "error": f"the models could not be loaded: {self.error}"}[status]
            if status == "error":  # a load that failed stays failed
                raise Refusal(503, why, "unavailable", final=True)
            raise Refusal(503, why, "unavailable", self.settings.retry_after_s)
        key = self.authorise(authorization)
        name = model or next(iter(self.engines))
        if name not in self.engines:
            raise Refusal(404, f"model {name!r} is not served; see /v1/models", "invalid_request_error",
                          param="model")
        return key, name, self.engines[name]

    async def admit(self, authorization: str | None, model: str | None, endpoint: str, params: dict, n: int,
                    **prompt) -> list[Generation]:
        """`start_choices` off the event loop (tokenizing a long prompt takes seconds), its request timeout
        counted from now: a conversation's turn on the threads kept for turns, anything else on asyncio's."""
        deadline = self._deadline()
        pool = self._turns if prompt.get("conversation") is not None else None
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, partial(
                self.start_choices, authorization, model, endpoint, params, n, deadline=deadline, **prompt))
        except RuntimeError:  # the turns' threads are gone: the server closed meanwhile
            if self._closed:
                raise self._shutting_down() from None
            raise

    def start_choices(self, authorization: str | None, model: str | None, endpoint: str, params: dict, n: int, *,
                      prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                      tools: list[dict] | None = None, conversation: tuple[str, str | None, str] | None = None,
                      tokens_asked: tuple[int, str] | None = None, deadline: float | None = None) -> list[Generation]:
        """Admit `n` choices of one prompt together and submit them (a `prompt`, or chat `messages` with their
        `tools` through the model's template, or the next turn of a `conversation` the server keeps: (its id,
        a system message or None, the user's text); `params` the engine's sampling settings, the i-th choice
        seeded `seed + i`). The prompt is tokenized, reserved in the quota and charged once; the queue places
        and every choice's new tokens are reserved at once, so either all run or none does (Refusal). A prompt
        that leaves less room than `tokens_asked` (new tokens the request set explicitly, and the field that
        set them) is refused, as OpenAI refuses it; a conversation kept here is compacted for them instead.
        Every choice is ended (504) at `deadline`, a `time.monotonic()` instant (the request timeout from now
        by default); a conversation's compaction is bound by it too."""
        if deadline is None:
            deadline = self._deadline()
        key, name, engine = self.engine_for(authorization, model)
        if time.monotonic() >= deadline:  # it waited that long for a thread
            self._reject(name, self._timed_out())
        fault = partial(_param_at_fault, prompt="messages" if messages is not None else "prompt",
                        schema="tools" if tools else "response_format")
        if self.guard.blocked(_said(prompt, messages, tools)):
            self._reject(name, Refusal(400, "the prompt contains blocked content", "content_filter"))
        blocked = self.guard.blocked_terms
        kept = self._take_turn(name, conversation) if conversation is not None else None
        try:
            try:
                sampling = SamplingParams(**{**params, "stop": list(params["stop"]) + list(blocked)})
                if kept is not None:  # its history compacted as needed to leave room for the reply
                    ids = kept.conversation.prompt(conversation[2], sampling.max_new_tokens, deadline)
                    kept.asked = True
                else:
                    if tools and not engine.template_renders_tools:  # told in a system message instead
                        messages = _with_system(messages, described(tools))
                    ids = engine.encode(engine.chat_prompt(messages, tools or None) if messages is not None else prompt)
            except ValueError as error:
                self._reject(name, Refusal(400, str(error), "invalid_request_error", param=fault(error)))
            except AtcError as error:  # a chat request to a model without a chat template
                self._reject(name, Refusal(400, error.message, "invalid_request_error", param="messages"))
            except TimeoutError:  # the conversation's summary was not written in time
                self._reject(name, self._timed_out())
            except EngineClosed:  # under the conversation's summary
                self._reject(name, self._shutting_down())
            except GenerationFailed:  # the conversation's summary failed in its step
                self._reject(name, Refusal(500, "generation failed", "server_error"))
            except Exception as error:  # the chat template's own errors (jinja's), or a prompt it cannot tokenize
                self._reject(name, Refusal(400, f"the prompt cannot be rendered or tokenized: {error}",
                                           "invalid_request_error"))
            if kept is None and tokens_asked is not None and len(ids) + tokens_asked[0] > engine.max_context_len:
                asked, field = tokens_asked
                self._reject(name, Refusal(
                    400, f"This model's maximum context length is {engine.max_context_len} tokens. However, you "
                         f"requested {len(ids) + asked} tokens ({len(ids)} in the prompt, {asked} in the "
                         f"completion). Please reduce the length of the prompt or completion.",
                    "invalid_request_error", param=field))
            choices = [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i) for i in range(n)]
            return self._admit(name, key, endpoint, blocked, ids, choices, deadline, kept, fault)
        except BaseException:
            if kept is not None:
                kept.end(None)
            raise

    def _take_turn(self, name: str, conversation: tuple[str, str | None, str]) -> "Turn":
        """The conversation's turn, held until its answer is in (409 while another turn of it runs)."""
        conversation_id, system, _ = conversation
        manager = self.conversations[name]
        lock = manager.lock(conversation_id)
        if not lock.acquire(blocking=False):
            self._reject(name, Refusal(409, f"a turn of conversation {conversation_id!r} is still running",
                                       "conflict", param="conversation_id"))
        kept = manager.get(conversation_id)
        if system is not None:
            kept.system = system
        return Turn(kept, lock)

    def start(self, authorization: str | None, model: str | None, endpoint: str, params: dict, **prompt) -> Generation:
        """`start_choices` of one choice."""
        return self.start_choices(authorization, model, endpoint, params, 1, **prompt)[0]

    def _admit(self, name: str, key: str | None, endpoint: str, blocked: tuple[str, ...], ids: list[int],
               choices: list[SamplingParams], deadline: float, turn: Turn | None = None,
               fault: Callable[[ValueError], str | None] = lambda _: None) -> list[Generation]:
        """Take the choices' places in the model's queue and reserve the quota they may use, all at once (so
        concurrent requests cannot all pass one check), then submit them; if one is refused by the engine,
        those submitted before it are ended as refused and their reservation given back whole."""
        engine = self.engines[name]
        each = [min(c.max_new_tokens, engine.max_context_len - len(ids)) for c in choices]
        reserved = len(ids) + sum(each)
        with self._lock:
            if self.closing:  # the drain began while this one was being tokenized
                raise self._shutting_down()
            if len(choices) > self.settings.max_pending:  # would never be admitted: not worth a retry
                self._reject(name, Refusal(400, f"n is {len(choices)}: more choices than the server runs at once "
                                                f"({self.settings.max_pending})", "invalid_request_error", param="n"))
            if self.pending[name] + len(choices) > self.settings.max_pending:
                self._reject(name, Refusal(429, "the server is at capacity; retry shortly", "rate_limit_exceeded",
                                           self.settings.retry_after_s))
            pages = [-(-(len(ids) + n) // engine.page_size) for n in each]
            self._check_memory(name, engine, sum(pages))
            left = self.guard.reserve(key, reserved)
            if left is not None:  # a quota never refills: no Retry-After (OpenAI's insufficient_quota)
                self._reject(name, Refusal(429, f"the token quota of this key is spent: this request may use "
                                                f"{reserved} tokens, {left} are left", "insufficient_quota",
                                           final=True))
            # last: once the breaker lets a half-open probe through, the request must run
            wait = self.breakers[name].admit() if self.settings.breaker_threshold else None
            if wait is not None:
                self.guard.refund(key, reserved)
                self._reject(name, Refusal(503, f"the model is failing: its last {self.settings.breaker_threshold} "
                                                f"requests failed; retry in {wait:.0f} s", "unavailable",
                                           max(1, round(wait))))
            self.pending[name] += len(choices)
            self._kv_demand[id(engine)] = self._kv_demand.get(id(engine), 0) + sum(pages)
        started: list[Generation] = []
        try:
            for i, sampling in enumerate(choices):
                request = engine.submit(ids, sampling)
                # kept by the engine: whoever waits for it may wake late on a busy host
                request.expire_at(deadline)
                generation = Generation(name, key, endpoint, request, blocked, each[i] + (len(ids) if i == 0 else 0),
                                        charges_prompt=i == 0, turn=turn if i == 0 else None, kv_pages=pages[i],
                                        deadline=deadline)
                started.append(generation)
                with self._lock:
                    self._in_flight.add(generation)
                # accounted when the engine is done with it, however it ends (even if nobody is left waiting)
                request.future.add_done_callback(lambda _, generation=generation: self._settle(generation))
        except Exception as error:  # settings the engine refuses (a grammar that does not compile), or closed
            for generation in started:
                self.end(generation, "refused")
            unsubmitted = len(choices) - len(started)
            with self._lock:
                if not started and self.settings.breaker_threshold:
                    self.breakers[name].record("cancelled")  # nothing ran: a half-open probe is let through again
                self.pending[name] -= unsubmitted
                self._kv_demand[id(engine)] -= sum(pages[len(started):])
            self.guard.refund(key, reserved - sum(g.reserved for g in started))
            if isinstance(error, ValueError):
                self._reject(name, Refusal(400, str(error), "invalid_request_error", param=fault(error)))
            raise
        return started

    def _check_memory(self, name: str, engine: LLMEngine, pages: int) -> None:
        """Refuse (503) a request that could take the process's resident memory past `max_memory_mb`: what
        is resident now, plus the KV pages never yet written that the requests in flight and this one could
        need at most (the pool is mapped lazily: a page costs memory from its first write). Called under
        the admission lock."""
        limit = self.settings.max_memory_mb
        if limit is None:
            return
        growth = 0
        for each in self._distinct_engines():
            demand = self._kv_demand.get(id(each), 0) + (pages if each is engine else 0)
            growth += max(0, min(demand, each.blocks.num_pages) - each.blocks.touched) * each.kv_bytes_per_page
        resident = resident_bytes()
        projected = resident + growth
        if projected <= limit * 2 ** 20:
            return
        # the request's own pages past the limit, with nothing else running: waiting cannot help
        if not any(self.pending.values()) and resident <= limit * 2 ** 20:
            self._reject(name, Refusal(400, f"the request could take the server's memory past its limit ({limit} "
                                            f"MiB) even alone: {projected / 2 ** 20:.0f} MiB; ask for fewer tokens",
                                       "invalid_request_error", param="max_tokens"))
        self._reject(name, Refusal(503, f"the server is near its memory limit ({limit} MiB): this request could "
                                        f"take it to {projected / 2 ** 20:.0f} MiB; retry shortly", "unavailable",
                                   self.settings.retry_after_s))

    def refused(self, authorization: str | None, model: str | None, endpoint: str, status: int) -> None:
        """Record a generation request refused (`status`) before it ran: the audit log has every request. A
        log that cannot be written (a full disk) does not turn the refusal into a 500."""
        try:
            self.guard.audit(self.guard.presented_key(authorization), model or "", endpoint, status)
        except OSError as error:
            _log.error("the audit log could not record a refused request: %s", error)

    def _reject(self, name: str, refusal: Refusal) -> NoReturn:
        self.metrics.rejected(name)
        raise refusal

    # ---- waiting -------------------------------------------------------------------------------------

    async def complete(self, generation: Generation,
                       disconnected: Callable[[], Awaitable[bool]] | None = None) -> Generation:
        """`complete_all` of one generation."""
        return (await self.complete_all([generation], disconnected))[0]

    async def complete_all(self, generations: list[Generation],
                           disconnected: Callable[[], Awaitable[bool]] | None = None) -> list[Generation]:
        """Wait for the whole answer of every choice, under one deadline; `disconnected()` is asked now and
        then whether the caller is gone. Refusal unless all completed (499 client gone, 504 timeout, 503
        shutdown, 500 failed): once one cannot complete, the others are ended for the same cause."""
        futures = {asyncio.wrap_future(g.settled): g for g in generations}
        deadline = min(g.deadline for g in generations)
        try:
            while not all(future.done() for future in futures):
                # woken at the deadline itself, so a timeout shorter than the poll still fires on time
                await asyncio.wait({f for f in futures if not f.done()}, timeout=_poll_interval(deadline),
                                   return_when=asyncio.FIRST_COMPLETED)
                if any(g.ended_by for g in generations):
                    continue
                lost = next((g for f, g in futures.items() if f.done() and g.outcome()[0] != 200), None)
                if lost is not None:
                    status = lost.outcome()[0]
                    self._end_all(generations, {500: "failed", 504: "timeout"}.get(status) or lost.ended_by or "client")
                elif disconnected is not None and await disconnected():
                    self._end_all(generations, "client")
                elif time.monotonic() > deadline:
                    self._end_all(generations, "timeout")
        except asyncio.CancelledError:
            self._end_all(generations, "client")
            raise
        for generation in generations:
            self._raise_unless_completed(generation)
        return generations

    def _end_all(self, generations: list[Generation], by: str) -> None:
        for generation in generations:
            if not generation.request.future.done():
                self.end(generation, by)

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        """The answer's text pieces as they come; Refusal at the end unless it completed (503 when the
        shutdown ended it, 504 past the request timeout, 500 when it failed). Leaving early cancels it."""
        finished = False
        try:
            async for piece in generation.request.aiter_text():
                yield piece
            finished = True
        finally:
            if not finished:
                self.end(generation, "client")
        # the end is sent once the request is accounted: a conversation's next turn, or the same key's next
        # request, sees its lock released and its quota refunded
        await asyncio.wrap_future(generation.settled)
        if generation.ended_by == "shutdown" or generation.request.finish_reason in ("error", "timeout"):
            self._raise_unless_completed(generation)

    def end(self, generation: Generation, by: str) -> None:
        """Cancel a request (`by` the client, the timeout, the shutdown, a sibling choice that `failed`, or
        the engine having `refused` a sibling); its pages go back to the pool."""
        if generation.ended_by is None:
            generation.ended_by = by
        generation.request.cancel()

    def _raise_unless_completed(self, generation: Generation) -> None:
        status, _ = generation.outcome()
        if status == 500:
            raise Refusal(500, "generation failed", "server_error")
        if status == 504:
            raise self._timed_out()
        if status == 503:
            raise Refusal(503, "the server shut down before the request finished", "unavailable")
        if status == 499:
            raise Refusal(499, "the client closed the request", "cancelled")

    def _deadline(self) -> float:
        """When a request arriving now is ended (504): the request timeout from now."""
        return time.monotonic() + self.settings.request_timeout_s

    def _timed_out(self) -> Refusal:
        return Refusal(504, f"the request took longer than {self.settings.request_timeout_s:g} s", "timeout")

    def _shutting_down(self) -> Refusal:
        return Refusal(503, "the server is shutting down", "unavailable", self.settings.retry_after_s)

    def _settle(self, generation: Generation) -> None:
        status, outcome = generation.outcome()
        try:
            self._account(generation, status, outcome)
        finally:  # even if the accounting failed (a full disk under the audit log): no slot or waiter is left
            with self._lock:
                if self.settings.breaker_threshold:
                    breaker = self.breakers[generation.model]
                    was_open = breaker.is_open
                    breaker.record(outcome)
                    if breaker.is_open and not was_open:
                        _log.error("model %s: %d requests failed in a row; refusing its requests for %g s",
                                   generation.model, breaker.failures, self.settings.breaker_cooldown_s)
                self.pending[generation.model] -= 1
                self._kv_demand[id(self.engines[generation.model])] -= generation.kv_pages
                self._in_flight.discard(generation)
            generation.settled.set_result(None)

    def _account(self, generation: Generation, status: int, outcome: str) -> None:
        if generation.turn is not None:
            generation.turn.end(generation.text if status == 200 else None)
        stats = generation.request.stats
        if generation.ended_by == "refused":  # counted once as rejected, charged nothing
            self.guard.refund(generation.key, generation.reserved)
        else:
            prompt_tokens = stats.prompt_tokens if generation.charges_prompt else 0
            self.metrics.finished(generation.model, stats, generation.finish_reason, outcome,
                                  generation.request.seq.params.max_new_tokens, prompt_tokens)
            self.guard.refund(generation.key, max(0, generation.reserved - prompt_tokens - stats.output_tokens))
            self.guard.audit(generation.key, generation.model, generation.endpoint, status, prompt_tokens,
                             stats.output_tokens, stats.total_s or 0.0)

    # ---- the end -------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet accounted."""
        return len(self._in_flight)

    def _admitted(self) -> bool:
        """Whether any request is past the closing check and not yet accounted: `pending` counts it from that
        check (under the same lock), `_in_flight` only once the engine has it."""
        with self._lock:
            return bool(self._in_flight) or any(self.pending.values())

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting; give what is in flight `grace_s` (the settings' by default) to finish, end the
        rest (503), wait until the engines are done with every request, then close."""
        self.closing = True
        deadline = time.monotonic() + (self.settings.shutdown_grace_s if grace_s is None else grace_s)
        while self._admitted() and time.monotonic() < deadline and not self._grace_over:
            await asyncio.sleep(_POLL_S)
        self._grace_over = True  # a signal from here on is uvicorn's to handle
        # each engine ends its cancelled requests before its next step: bounded by one step. Ended again
        # each round: one admitted while the signal came (past the closing check, still being submitted)
        # is ended too once it is in flight, and the engines are not closed under it
        while self._admitted():
            with self._lock:
                left = [generation for generation in self._in_flight if generation.ended_by is None]
            for generation in left:
                self.end(generation, "shutdown")
            await asyncio.sleep(_POLL_S)
        self.close()

    def stop_waiting(self) -> bool:
        """End the drain's grace now, so what is still in flight is ended with 503 (a second signal); False
        when it was already over."""
        cut, self._grace_over = not self._grace_over, True
        return cut

    def close(self) -> None:
        """Close the engines (what still runs is cancelled, its pages freed) and the audit log."""
        self.closing = True
        if self._closed:
            return
        self._closed = True
        if self._turns is not None:  # a turn still waiting for a thread finds the server closed (503)
            self._turns.shutdown(wait=False)
        for engine in self._distinct_engines():
            engine.close()
        self.guard.close()


_MEMORY_MARGIN = 0.1  # of --max-memory, left to what grows beside the KV pools


def _poll_interval(deadline: float) -> float:
    """A quarter second, or less when the deadline comes sooner (after it: a quarter second again, while the
    cancelled request winds down)."""
    left = deadline - time.monotonic()
    return min(0.25, left) if left > 0 else 0.25


def _param_at_fault(error: ValueError, prompt: str, schema: str) -> str | None:
    """The request field a refusal by the engine's checks is about, as OpenAI names it: a sampling setting,
    the prompt (`prompt` or `messages`, also when the KV pool cannot hold it), or the schema a structured
    output or a tool call is generated under (`response_format` or `tools`); None for any other refusal."""
    setting = getattr(error, "setting", None)
    renamed = {"prompt": prompt, "tokenizer": prompt, "kv_cache_pages": prompt, "kv_cache_memory_mb": prompt,
               "max_new_tokens": "max_tokens", "structured_output": schema}
    return renamed.get(setting, setting if setting in _SAMPLING_FIELDS else None)


_SAMPLING_FIELDS = frozenset(item.name for item in fields(SamplingParams))


def _said(prompt: str | list[int] | None, messages: list[dict] | None, tools: list[dict] | None) -> str:
    """All the text a request puts before the model, for the block list: the prompt or the messages (their
    tool calls' arguments included) and the tools' definitions."""
    if messages is None:
        return prompt if isinstance(prompt, str) else ""
    parts = [m["content"] for m in messages]
    arguments = [c["function"]["arguments"] for m in messages for c in m.get("tool_calls", ())]
    parts += [a if isinstance(a, str) else json.dumps(a, ensure_ascii=False) for a in arguments]
    parts += [json.dumps(t, ensure_ascii=False) for t in tools or ()]
    return "\n".join(parts)


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """`text` at the head of the system message (one is added when there is none)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
