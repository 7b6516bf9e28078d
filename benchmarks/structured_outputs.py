"""What a structured output costs: the grammar engines' mask per token, and the engine's decode with a JSON
schema against the same decode without one, at batch 1 and 32.

    python benchmarks/structured_outputs.py --om .cache/peers/smollm2-int4-awq-head4.om

1. Grammar engines (the choice behind cann_llm/runtime/engine/structured.py), on the model's own vocabulary: the time
   to compile a JSON schema, and the median time of the token mask along the tokens of a valid instance,
   for llguidance and outlines-core (xgrammar is left out: its wheel requires torch, which the runtime may
   not). Each is asked for the mask as the sampler needs it (a bitmask over the vocabulary).
2. The engine: as many requests as the batch (1 and 32), submitted at once, greedy, each with a schema
   (up to `--tokens`; the JSON ends by itself) and then without one for as many tokens (EOS held off);
   alternated over `--rounds`, medians of tokens/s.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_llm.runtime.engine.engine import LLMEngine  # noqa: E402
from cann_llm.runtime.engine.sampling import SamplingParams  # noqa: E402
from cann_llm.runtime.engine.structured import JSON_LAYOUT, StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "W1"}}


def llguidance_masks(tokenizer_json: str, vocab_size: int, eos: list[int], ids: list[int]) -> dict:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_LAYOUT))
    compiled = time.perf_counter() - start
    bits, times = allocate_token_bitmask(1, vocab_size), []
    for token in ids:
        start = time.perf_counter()
        fill_next_token_bitmask(matcher, bits)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return {"compile_s": compiled, "mask_us": 1e6 * statistics.median(times), "accepted": True}


def outlines_masks(tokenizer_json: str, vocab_size: int, eos: int, ids: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    tokens: dict[str, list[int]] = {}
    for text, token in Tokenizer.from_str(tokenizer_json).get_vocab().items():
        if token != eos:
            tokens.setdefault(text, []).append(token)
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, tokens))
    compiled = time.perf_counter() - start
    guide, bits, times = Guide(index), np.zeros((vocab_size + 31) // 32, np.int32), []
    accepted = True
    for token in ids:
        start = time.perf_counter()
        guide.write_mask_into(bits.ctypes.data, bits.size, bits.itemsize)
        times.append(time.perf_counter() - start)
        try:
            guide.advance(token)
        except Exception:  # its JSON regex spells whitespace differently: the path ends here
            accepted = False
            break
    return {"compile_s": compiled, "mask_us": 1e6 * statistics.median(times), "accepted": accepted}


def decode_rate(engine: LLMEngine, prompt: list[int], requests: int, tokens: int, schema: bool) -> tuple[float, int]:
    """(tokens/s, the shortest output) of `requests` requests submitted at once."""
    constraint = StructuredOutput(json=SCHEMA) if schema else None
    params = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=not schema, structured_output=constraint)
    start = time.perf_counter()
    handles = [engine.submit(prompt, params) for _ in range(requests)]
    lengths = [len(h.output_ids) for h in handles if h.result() is not None]
    return sum(lengths) / (time.perf_counter() - start), min(lengths)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", default=48, show_default=True, help="new tokens a request")
@click.option("--rounds", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(om_path: str, tokens: int, rounds: int, threads: int) -> None:
    """Print the grammar engines' costs and the engine's tokens/s with and without a schema."""
    probe = LLMEngine(om_path, max_context_len=512, kv_cache_pages=8, threads=threads)
    files = probe.loaded.om.tokenizer_files()
    ids = probe.tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    eos = sorted(probe.tokenizer.eos_token_ids)
    vocab = probe.vocab_size
    probe.close()
    click.echo(f"grammar engines, a {len(ids)}-token instance of the schema, vocabulary {vocab}:")
    for name, row in (("llguidance", llguidance_masks(files["tokenizer.json"], vocab, eos, ids)),
                      ("outlines-core", outlines_masks(files["tokenizer.json"], vocab, eos[0], ids))):
        note = "" if row["accepted"] else " (its regex refused the instance's tokens part-way)"
        click.echo(f"  {name:14s} compile {1000 * row['compile_s']:8.1f} ms   mask {row['mask_us']:8.1f} us a token{note}")
    for batch in (1, 32):
        engine = LLMEngine(om_path, max_batch_size=batch, max_context_len=512, kv_cache_pages=batch * 2 + 8,
                           threads=threads, process_thread_pool=True)
        prompt = engine.chat_prompt([{"role": "user", "content": "Describe a person as JSON."}])
        rates = {False: [], True: []}
        decode_rate(engine, prompt, batch, 8, True)  # warm: the tokenizer wrapped, the kernels built
        for _ in range(rounds):  # the free run makes as many tokens as the schema's run ended with
            rate, made = decode_rate(engine, prompt, batch, tokens, True)
            rates[True].append(rate)
            rates[False].append(decode_rate(engine, prompt, batch, made, False)[0])
        engine.close()
        free, held = statistics.median(rates[False]), statistics.median(rates[True])
        click.echo(f"batch {batch:2d}: {free:7.1f} tok/s without a schema, {held:7.1f} with one: "
                   f"{1000 * batch / held - 1000 * batch / free:+.2f} ms a step ({held / free:.3f}x)")


if __name__ == "__main__":
    main()
