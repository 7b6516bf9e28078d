"""The needle test for long documents: a fact placed at 10 depths of a 32K-token document of held-out prose
(cann_llm/models/data/eval.txt, repeated), a question about it, and the passages `--context_file` keeps for it
(cann_llm/runtime/long_context.py). For each depth: whether the kept passages hold the fact, and whether the
model's greedy answer states it.

    python benchmarks/needle.py --om .cache/smollm2.om [--tokens 32768] [--context 2048] [--depths 10] \\
        [--scoring bm25|hybrid] [--question "..."]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_llm.runtime.long_context import SCORINGS, LongContext  # noqa: E402
from cann_llm.runtime.tokenizer import TextTokenizer  # noqa: E402

PROSE = Path(__file__).resolve().parents[1] / "cann_llm" / "models" / "data" / "eval.txt"
NEEDLE = "The secret passphrase of the harbour office is amber-falcon-42."
ANSWER = "amber-falcon-42"
QUESTION = "What is the secret passphrase of the harbour office?"


def needle_document(tokenizer: TextTokenizer, tokens: int, depth: float) -> str:
    """Held-out prose repeated to `tokens` tokens, the needle put at `depth` (0-1) of it, after a sentence."""
    prose = PROSE.read_text()
    text = prose
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += "\n\n" + prose
    _, offsets = tokenizer.encode_with_offsets(text)
    text = text[:offsets[tokens - 1][1]]
    at = text.find(". ", int(len(text) * depth)) + 1
    return f"{text[:at]} {NEEDLE}{text[at:]}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", "om_path", required=True, help="a chat model's artifact (with its tokenizer)")
@click.option("--tokens", default=32_768, show_default=True, help="the document's length in tokens")
@click.option("--context", default=2048, show_default=True, help="the engine's max_context_len")
@click.option("--depths", default=10, show_default=True, help="placements, evenly from 5% to 95% deep")
@click.option("--reply_tokens", default=32, show_default=True)
@click.option("--scoring", type=click.Choice(SCORINGS), default="bm25", show_default=True,
              help="LongContext's ranking of the passages")
@click.option("--question", default=QUESTION, show_default=True,
              help="the question asked (a paraphrase tests ranking beyond shared words)")
def main(om_path: str, tokens: int, context: int, depths: int, reply_tokens: int, scoring: str, question: str) -> None:
    """Print, per depth, whether the kept passages and the answer hold the needle, then the counts."""
    from cann_llm.runtime.engine.engine import LLMEngine

    kept = answered = 0
    with LLMEngine(om_path, max_context_len=context, kv_cache_pages=max(64, context // 64)) as engine:
        long_context = LongContext(engine.tokenizer, scoring=scoring, embed=engine.embed_tokens)
        for i in range(depths):
            depth = (i + 0.5) / depths
            document = needle_document(engine.tokenizer, tokens, depth)
            start = time.perf_counter()
            prompt, selection = long_context.prompt(engine, document, question, reply_tokens)
            chosen = time.perf_counter() - start
            answer = engine.generate(prompt, max_new_tokens=reply_tokens, temperature=0)
            kept += NEEDLE in selection.text
            answered += ANSWER in answer
            click.echo(f"depth {depth:4.0%}: kept {'yes' if NEEDLE in selection.text else 'no ':3} "
                       f"({selection.tokens} of {selection.document_tokens} tokens, chosen in {chosen * 1000:.0f} ms), "
                       f"answer {'yes' if ANSWER in answer else 'no '}: {answer.strip()[:80]!r}")
    click.echo(f"needle kept in {kept} of {depths} placements; the answer states it in {answered} of {depths}")


if __name__ == "__main__":
    main()
