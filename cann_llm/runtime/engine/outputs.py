"""What `LLMEngine.generate` returns for a list of prompts: vLLM's `RequestOutput` / `CompletionOutput` shape."""

from __future__ import annotations

from dataclasses import dataclass

from cann_llm.runtime.engine.sequence import RequestStats, TokenLogprob


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence: `index` among the prompt's `n`, its text and tokens, why it ended, and (when
    asked for) each token's log-probability."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | None = None  # the stop string that ended it, if one did

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's outputs (`n` of them) with the prompt as it ran, each output's timings, and (when asked
    for) each prompt token's log-probability (the first's is None)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: list[RequestStats]
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = True
