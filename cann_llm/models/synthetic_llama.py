"""A Llama-architecture model of a chosen size with random weights, exported as users export (PyTorch's dynamo
exporter, transformers' defaults) with its weights in external data: the input `atc --large_model_compilation`
is proved on, since no model hub is reachable and no real model that size ships in a package.

    python -m cann_llm.models.synthetic_llama --gigabytes 6 --out .cache/synthetic-6g

Sizes: hidden 2048, intermediate 5632, 16 heads of 128 (4 KV heads), vocabulary 32,000, untied head, float32;
the layer count is chosen to reach the size asked for (about 0.2 GB a layer).
"""

from __future__ import annotations

from pathlib import Path

import click

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 4, 32_000


def layers_for(gigabytes: float) -> int:
    """Decoder layers that bring the float32 weights to about `gigabytes` GB."""
    head_dim = HIDDEN // HEADS
    per_layer = HIDDEN * (HEADS + 2 * KV_HEADS) * head_dim + HEADS * head_dim * HIDDEN + 3 * HIDDEN * INTERMEDIATE
    embeddings = 2 * VOCAB * HIDDEN
    return max(1, round((gigabytes * 1e9 / 4 - embeddings) / per_layer))


def build(gigabytes: float, out: Path, seed: int = 0) -> Path:
    """Export the model to `out`/model.onnx (+ model.onnx.data); returns the path."""
    import torch
    import transformers

    from cann_llm.models.export import export_causal_lm

    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, num_hidden_layers=layers_for(gigabytes),
                                      vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    # random weights drawn layer by layer, small enough that activations stay finite through every layer
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        model.model.rotary_emb.__init__(config)  # buffers (inverse frequencies) made on the meta device
    return export_causal_lm(model.eval(), out / "model.onnx", dynamo=True, with_past=True, external_data=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gigabytes", type=float, default=6.0, show_default=True, help="float32 weight bytes, in GB")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def main(gigabytes: float, out: Path) -> None:
    """Build and export the model."""
    click.echo(f"{layers_for(gigabytes)} layers; exporting to {out / 'model.onnx'}", err=True)
    click.echo(build(gigabytes, out))


if __name__ == "__main__":
    main()
