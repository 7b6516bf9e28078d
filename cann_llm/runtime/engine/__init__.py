"""The serving engine: requests, sequences, the block manager and scheduler, the runners, sampling and
speculation (`LLMEngine` in cann_llm/runtime/engine/engine.py)."""
