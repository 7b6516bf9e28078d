"""The engine settings `atc --auto_tune_mode` recorded in an artifact against EngineConfig's defaults, measured
side by side: batch-1 greedy decode and a 1,024-token prefill (cann_llm/runtime/engine/tuning.py), each setting in a
process of its own, alternating, medians of the per-round ratios.

    python benchmarks/tuned_settings.py --om .cache/tuned/smollm2-int4.om [--rounds 5]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cann_llm.compiler.auto_tune import compare_with_defaults  # noqa: E402
from cann_llm.runtime.artifact import OmFile  # noqa: E402
from cann_llm.runtime.engine.tuning import tuned_settings  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--om", required=True, help="an artifact compiled with --auto_tune_mode")
@click.option("--rounds", default=5, show_default=True)
def main(om: str, rounds: int) -> None:
    """Print each round's rates, then the median ratios."""
    settings = tuned_settings(OmFile(om).metadata)
    click.echo(f"tuned settings: {json.dumps(settings) if settings else 'the defaults (nothing beat them)'}")

    def report(number: int, default: dict, tuned: dict) -> None:
        click.echo(f"round {number}: defaults decode {default['decode_tok_s']:.1f} tok/s, prefill "
                   f"{default['prefill_tok_s']:.0f} tok/s; tuned {tuned['decode_tok_s']:.1f}, {tuned['prefill_tok_s']:.0f}")

    effect = compare_with_defaults(Path(om), settings, rounds, report)
    click.echo(f"tuned / defaults: decode {effect['decode']:.3f}x, prefill {effect['prefill']:.3f}x")


if __name__ == "__main__":
    main()
