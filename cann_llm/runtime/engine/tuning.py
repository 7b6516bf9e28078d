"""Engine settings measured for an artifact on this machine (`atc --auto_tune_mode`), and the trial that
measures one setting.

The artifact's `tuning` section holds the settings the search chose (`settings`: only those that differ
from `EngineConfig`'s defaults), every trial and the effect measured against the defaults. `LLMEngine` built
without a config starts from those settings; anything given explicitly wins.

A trial runs in a process of its own (`python -m cann_llm.runtime.engine.tuning OM SETTINGS_JSON`): the thread count
fixes onnxruntime's process-wide pool, which a process can make once.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

TUNABLE = ("threads", "native_matmul", "max_num_batched_tokens")
DECODE_PROMPT, DECODE_TOKENS, PREFILL_TOKENS = 32, 64, 1024


def tuned_settings(metadata: dict) -> dict:
    """The engine settings the artifact was tuned to (empty when it was not)."""
    settings = (metadata.get("tuning") or {}).get("settings") or {}
    return {key: value for key, value in settings.items() if key in TUNABLE}


def measure(om: str, settings: dict, repeats: int = 3) -> dict:
    """Batch-1 greedy decode rate and prefill rate of `om` under `settings`, medians of `repeats`."""
    from cann_llm.runtime.engine.engine import LLMEngine
    from cann_llm.runtime.engine.sampling import SamplingParams

    with LLMEngine(om, process_thread_pool=True, max_batch_size=1, max_context_len=PREFILL_TOKENS + 16,
                   kv_cache_pages=64, enable_prefix_caching=False, **settings) as engine:
        vocab = engine.vocab_size
        decode_prompt = [(7 * i + 3) % vocab for i in range(DECODE_PROMPT)]
        # a model whose positions end sooner (a position table's rows) is measured on as many as it reads
        prefill_tokens = min(PREFILL_TOKENS, engine.max_context_len - 1)
        prefill_prompt = [(13 * i + 5) % vocab for i in range(prefill_tokens)]
        decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.generate([decode_prompt], decode)  # warm: kernels compiled, pages touched
        decode_rates, prefill_rates = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.generate([decode_prompt], decode)
            decode_rates.append(DECODE_TOKENS / (time.perf_counter() - start))
            start = time.perf_counter()
            engine.generate([prefill_prompt], one)
            prefill_rates.append(prefill_tokens / (time.perf_counter() - start))
    return {"decode_tok_s": round(statistics.median(decode_rates), 2),
            "prefill_tok_s": round(statistics.median(prefill_rates), 2)}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
