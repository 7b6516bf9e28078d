"""`SamplingParams`: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cann_llm.runtime.engine.checked import boolean, integer, real
from cann_llm.runtime.engine.setting_error import SettingError
from cann_llm.runtime.engine.structured import StructuredOutput

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# beyond these a penalty or a temperature scales float32 logits past their range (inf - inf is NaN)
PENALTY_RANGE = (1e-2, 1e2)
MIN_TEMPERATURE = 1e-3
INTEGERS = ("max_new_tokens", "top_k", "min_tokens", "n", "priority")
OPTIONAL_INTEGERS = ("seed", "logprobs", "prompt_logprobs", "max_tokens")
REALS = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; `temperature=0` is greedy. Checked on construction (ValueError):
    numbers finite and in range.

    The names are vLLM's where they overlap (`max_tokens` is taken for `max_new_tokens`): penalties as
    OpenAI defines them (`presence_penalty` once for a token already generated, `frequency_penalty` per
    time), `min_tokens` before end-of-sequence may come, `logprobs` top alternatives reported per
    generated token (0: the chosen token's alone; computed from the model's own logits, before any
    penalty or temperature), `logit_bias` {token id: bias} added to the logits (OpenAI's, in [-100, 100]),
    `prompt_logprobs` the same for each prompt token after the first (the prompt is then computed whole, never
    taken from the prefix cache), `structured_output` a constraint on the text (cann_llm/runtime/engine/structured.py),
    and `n` outputs per prompt for `LLMEngine.generate` (each a sequence of its own, seeded `seed + i`).
    `priority` orders admission as vLLM's priority scheduling does: lower is admitted first, ties by arrival,
    and a waiting request rises a level every `EngineConfig.priority_aging_s` seconds, so none starves.
    """

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None
    n: int = 1
    priority: int = 0
    max_tokens: int | None = None  # vLLM's name for max_new_tokens; wins when given

    def __post_init__(self) -> None:
        self._coerce_types()
        if self.max_tokens is not None:
            object.__setattr__(self, "max_new_tokens", self.max_tokens)
            object.__setattr__(self, "max_tokens", None)
        numbers = {"temperature": self.temperature, "top_p": self.top_p, "repetition_penalty": self.repetition_penalty,
                   "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}
        for name, value in numbers.items():
            if not math.isfinite(value):
                raise SettingError(name, f"{name} must be a finite number, not {value!r}")
        low, high = PENALTY_RANGE
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            ("temperature", self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
             f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}"),
            ("top_p", 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "top_k must be 0 (off) or positive"),
            ("repetition_penalty", low <= self.repetition_penalty <= high,
             f"repetition_penalty must be in [{low:g}, {high:g}]"),
            ("seed", self.seed is None or 0 <= self.seed < 2 ** 64, "seed must be in [0, 2**64)"),
            ("stop", all(self.stop), "stop strings must not be empty"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_new_tokens, "min_tokens must be in [0, max_new_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            ("n", self.n >= 1, "n must be at least 1"),
            ("logit_bias", all(math.isfinite(b) and -100 <= b <= 100 for _, b in self.logit_bias),
             "logit_bias values must be in [-100, 100]"),
        )
        for setting, ok, message in checks:
            if not ok:
                raise SettingError(setting, message)

    def _coerce_types(self) -> None:
        """Each field as its type (numpy's integers and floats taken as Python's); TypeError for a value of
        another type, so a request is refused when it is made rather than failing in a step."""
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in INTEGERS:
            put(name, integer(name, getattr(self, name)))
        for name in OPTIONAL_INTEGERS:
            if getattr(self, name) is not None:
                put(name, integer(name, getattr(self, name)))
        for name in REALS:
            put(name, real(name, getattr(self, name)))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(text, str) for text in stop):
            raise TypeError("stop must be a string or a sequence of strings")
        put("stop", stop)
        put("stop_token_ids", tuple(integer("a stop token id", t) for t in self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        put("logit_bias", tuple((integer("a logit_bias token id", t), real("a logit_bias value", b)) for t, b in bias))
        put("ignore_eos", boolean("ignore_eos", self.ignore_eos))
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise TypeError(f"structured_output must be a StructuredOutput (StructuredOutput(json=schema), "
                            f"...), not {type(self.structured_output).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether the logits are changed by what was generated before."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))
