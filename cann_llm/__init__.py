"""The public Python face of the runtime: `from cann_llm import LLMEngine`."""

from runtime.engine import EngineStats, LLMEngine, Request
from runtime.sampling import SamplingParams
from runtime.sequence import RequestStats

__all__ = ["EngineStats", "LLMEngine", "Request", "RequestStats", "SamplingParams"]
